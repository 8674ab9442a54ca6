"""The all-reduce of a tensor-parallel step (o_proj, down_proj, embedding rows: one per use).

Chosen by WARPLOOP_TP_ALLREDUCE:
- `nccl` (the default; `auto` is the same): torch.distributed.all_reduce (NCCL on GPUs, gloo on the
  CPU), captured in the decode step's CUDA graphs.
- `symm`: torch's symmetric-memory one-shot all-reduce (`torch.ops.symm_mem.one_shot_all_reduce_copy`):
  one kernel copies this rank's rows into a buffer every rank has mapped over NVLink, meets the
  other ranks at a barrier in memory and sums every rank's copy; a barrier at its end lets the next
  call reuse the buffer. Tensors larger than the buffer (long prefills) go through NCCL. NVIDIA GPUs,
  float32 and bfloat16 only.

Measured on two H100s (torch 2.11, Llama-3.1-8B shapes, BENCHMARKS.md "Tensor parallelism"): the
same ms/token at batch 1 (4.271 symm, 4.256 NCCL) and tokens/s at batch 32, so NCCL stays the
default. `symm` sets up once per process: a second tensor-parallel group in the same process (an
engine closed, then another built) waited forever in the symmetric-memory rendezvous, so a second
setup is refused rather than left to hang.

Every rank makes the same choice (the workers inherit the environment), and setting up the buffer
is a collective that every rank reaches while building its backend.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

MODES = ("auto", "nccl", "symm")
BUFFER_ROWS = 256     # rows of the model width in the symmetric buffer: decode batches and short prefills
_SET_UP = []          # symmetric-memory setups in this process (at most one works: see above)


def mode_from_env() -> str:
    mode = os.environ.get("WARPLOOP_TP_ALLREDUCE", "auto").strip().lower() or "auto"
    if mode not in MODES:
        raise ValueError(f"WARPLOOP_TP_ALLREDUCE={mode!r}: choose one of {', '.join(MODES)}")
    return mode


def check_mode(device, dtype) -> str:
    """The mode WARPLOOP_TP_ALLREDUCE asks for, refused here (before any rank starts) where it cannot work."""
    mode = mode_from_env()
    if mode == "symm":
        if _SET_UP:
            raise RuntimeError("WARPLOOP_TP_ALLREDUCE=symm works for one tensor-parallel engine per process, and "
                               "this process already built one (a second symmetric-memory rendezvous hangs); "
                               "use nccl, or start a new process")
        if device.type != "cuda" or torch.version.hip is not None or dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"WARPLOOP_TP_ALLREDUCE=symm needs NVIDIA GPUs and float32 or bfloat16 (here: "
                             f"{device.type}, {dtype}); use nccl")
    return mode


class AllReduce:
    """sum over the default group of a rank's partial tensor: `reduce(partial)` returns the sum."""

    def __init__(self, device, dtype, width: int, rows: int = BUFFER_ROWS) -> None:
        self.buffer, self.group_name = None, None
        if check_mode(device, dtype) == "symm":
            self._setup(device, dtype, rows * width)
            _SET_UP.append(self.group_name)
        self.mode = "symm" if self.buffer is not None else "nccl"

    def _setup(self, device, dtype, numel: int) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        group = dist.group.WORLD
        self.group_name = group.group_name
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        if enable is not None and getattr(enable, "__deprecated__", None) is None:
            enable(self.group_name)     # older torch needs it; newer ones deprecate it
        buffer = symm_mem.empty(numel, dtype=dtype, device=device)
        symm_mem.rendezvous(buffer, group)
        self.buffer = buffer

    def __call__(self, partial: torch.Tensor) -> torch.Tensor:
        n = partial.numel()
        if self.buffer is None or n > self.buffer.numel() or partial.dtype != self.buffer.dtype:
            dist.all_reduce(partial)
            return partial
        out = torch.empty_like(partial)
        torch.ops.symm_mem.one_shot_all_reduce_copy_out(self.buffer[:n].view(partial.shape), partial.contiguous(),
                                                        "sum", self.group_name, out)
        return out
