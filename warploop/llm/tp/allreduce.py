"""The all-reduce of a tensor-parallel step (o_proj, down_proj, embedding rows: one per use).

Two ways, chosen by WARPLOOP_TP_ALLREDUCE:
- `nccl`: torch.distributed.all_reduce (NCCL on GPUs, gloo on the CPU). A decode step's all-reduces
  are a few KB each (rows x hidden), where NCCL's fixed cost per call dominates.
- `symm`: torch's symmetric memory one-shot all-reduce (`torch.ops.symm_mem.one_shot_all_reduce_copy`):
  one kernel copies this rank's rows into a buffer every rank has mapped over NVLink, meets the
  other ranks at a barrier in memory, and sums every rank's copy; a barrier at its end lets the
  next call reuse the buffer. It is captured in CUDA graphs like any kernel. Tensors larger than
  the buffer (long prefills) and dtypes it lacks (float16) go through NCCL.
- `auto` (default): `symm` on NVIDIA GPUs where the buffer can be set up, else `nccl`.

Every rank makes the same choice (the same environment, the same device kind), and setting up the
buffer is a collective that every rank reaches while building its backend.
"""
from __future__ import annotations

import os
import warnings

import torch
import torch.distributed as dist

MODES = ("auto", "nccl", "symm")
BUFFER_ROWS = 256     # rows of the model width in the symmetric buffer: decode batches and short prefills


def mode_from_env() -> str:
    mode = os.environ.get("WARPLOOP_TP_ALLREDUCE", "auto").strip().lower() or "auto"
    if mode not in MODES:
        raise ValueError(f"WARPLOOP_TP_ALLREDUCE={mode!r}: choose one of {', '.join(MODES)}")
    return mode


class AllReduce:
    """sum over the default group of a rank's partial tensor: `reduce(partial)` returns the sum."""

    def __init__(self, device, dtype, width: int, mode: str | None = None, rows: int = BUFFER_ROWS) -> None:
        mode = mode or mode_from_env()
        self.buffer, self.group_name = None, None
        usable = (device.type == "cuda" and torch.version.hip is None
                  and dtype in (torch.float32, torch.bfloat16))
        if mode == "symm" and not usable:
            raise ValueError(f"WARPLOOP_TP_ALLREDUCE=symm needs NVIDIA GPUs and float32 or bfloat16 (here: "
                             f"{device.type}, {dtype}); use auto or nccl")
        if mode in ("auto", "symm") and usable:
            try:
                self._setup(device, dtype, rows * width)
            except Exception as e:  # an older torch, no P2P between the GPUs: NCCL still works
                if mode == "symm":
                    raise
                warnings.warn(f"symmetric-memory all-reduce unavailable ({type(e).__name__}: {e}); using NCCL",
                              RuntimeWarning, stacklevel=2)
                self.buffer = None
        self.mode = "symm" if self.buffer is not None else "nccl"

    def _setup(self, device, dtype, numel: int) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        group = dist.group.WORLD
        self.group_name = group.group_name
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        if enable is not None and getattr(enable, "__deprecated__", None) is None:
            # older torch needs it. Newer ones deprecate it, and calling it there caches the group's
            # store by name: a second group in this process (same name "0") then waited forever in
            # rendezvous on the first group's store (two H100s, torch 2.11)
            getattr(symm_mem, "_group_name_to_store", {}).pop(self.group_name, None)   # a closed group's
            enable(self.group_name)
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
