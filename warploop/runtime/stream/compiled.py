"""Compile the streaming kernel for a GPU that need not be here, and report its resources.

    ck = compile_for(StreamConfig(), arch=90)     # no GPU needed
    report(ck)   # {"shared": ..., "n_regs": ..., "spill_bytes": ..., "roles": {"consumer": 232, "loader": 40}, ...}

The same binder and options as the JIT's launch path, so the GPU process compiles the same kernel.
"""
from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import tempfile

# The PTX of a warp-specialized ring kernel holds these; tests assert on them.
PTX_MARKERS = ("cp.async.bulk.tensor", "mbarrier.try_wait", "mbarrier.arrive", "setmaxnreg",
               "ld.global.gpu.acquire", ".global.gpu.release")   # atom. (3.6) or red. (3.9)


SWIZZLE_COLS = 64                 # bf16 columns in 128 bytes: a swizzled TMA box's width


@dataclasses.dataclass(frozen=True)
class StreamConfig:
    """The kernel's compile-time shape: tile rows BR, chunk width BK, ring slots NBUF, the widest
    input KMAX, and the polls before a wait gives up (a poll is one L2 round trip, under a µs)."""
    block_rows: int = 32
    block_k: int = 256
    ring: int = 8
    kmax: int = 8192
    spin: int = 1 << 24
    head_dim: int = 0             # attention (kinds.ATTN) compiled in for this head size (0: none)
    attn_group: int = 4           # q heads per KV head the attention body holds (a power of two >= the group)
    attn_tile: int = 32           # context tokens per attention step (at most kv_tokens)
    batch_rows: int = 0           # GEMVs of up to this many rows (kinds.GEMV batch): 0 (batch 1), 16, 32, 64
    x_stage_kb: int = 32          # with batch_rows: shared memory for the stages of x (x_stages)
    trace: bool = False           # ns stamps per instruction into StreamExecutor.trace (kinds.TRACE_STAMPS)
    tensor_parallel: bool = False  # the all-reduce body (kinds.ALLREDUCE) compiled in: a rank's program
    attn_wgmma: bool = False      # with batch_rows, head_dim 64 or 128: attention's products on wgmma (attention.py)
    attn_kv_split: bool = False   # with attn_wgmma at head_dim 64: kv_split too (128-token chunks, a slot the keys')
    wgmma_pipe: bool = False      # wgmma tiles: a chunk's products in flight while the next chunk's issue (gemv_rows)
    gemv_tall: bool = False       # wgmma tiles: stages of many tiles take tall ones (kinds.GEMV tall: 2 slots a chunk)

    def __post_init__(self):
        if self.block_k not in (64, 128, 256):
            raise ValueError(f"block_k must be 64, 128 or 256 (a TMA box is at most 256 wide), not {self.block_k}")
        if self.block_rows not in (16, 32, 64):
            raise ValueError(f"block_rows must be 16, 32 or 64, not {self.block_rows}")
        if self.head_dim not in (0, 16, 32, 64, 128, 256):
            raise ValueError(f"head_dim must be 0 (no attention) or a power of two from 16 to 256, not {self.head_dim}")
        if self.attn_group < 1 or self.attn_group & (self.attn_group - 1) or self.attn_group > 16:
            raise ValueError(f"attn_group must be a power of two from 1 to 16, not {self.attn_group}")
        if self.attn_tile not in (16, 32, 64):
            raise ValueError(f"attn_tile must be 16, 32 or 64, not {self.attn_tile}")
        rows, br, bk = self.batch_rows, self.block_rows, self.block_k
        if rows not in (0, 16, 32, 64) or (rows and (br < 32 or bk < 128)) or (rows == 64 and br != 64):
            raise ValueError(f"batch_rows must be 0 (batch 1 only), 16, 32 or 64, with block_rows at least 32 (64 for "
                             f"64 rows: wgmma tiles) and block_k at least 128 (a tile is an mma's side, x's stages a "
                             f"column block each), not {self.batch_rows} with block_rows {self.block_rows}, block_k "
                             f"{self.block_k}")
        if self.attn_wgmma and (not self.batch_rows or self.head_dim not in (64, 128)):
            raise ValueError(f"attn_wgmma needs batch_rows (its q and scores stage in x's shared memory) and "
                             f"head_dim 64 or 128, not batch_rows {self.batch_rows}, head_dim {self.head_dim}")
        if self.attn_kv_split and not (self.attn_wgmma and self.head_dim == 64):
            raise ValueError("attn_kv_split needs attn_wgmma at head_dim 64 (head_dim 128 always splits)")
        if self.wgmma_pipe and not (self.batch_rows and self.block_rows == 64 and self.x_stages >= 4):
            raise ValueError(f"wgmma_pipe needs wgmma tiles (batch_rows with block_rows 64) and 4 or more stages of x "
                             f"(x_stage_kb), not batch_rows {self.batch_rows}, block_rows {self.block_rows}, "
                             f"{self.x_stages} stages")
        if self.gemv_tall and not (self.batch_rows and self.block_rows == 64 and not self.wgmma_pipe):
            raise ValueError(f"gemv_tall needs wgmma tiles (batch_rows with block_rows 64), not with wgmma_pipe; "
                             f"not batch_rows {self.batch_rows}, block_rows {self.block_rows}, "
                             f"wgmma_pipe {self.wgmma_pipe}")
        if self.x_stage_kb < 1:
            raise ValueError(f"x_stage_kb must be at least 1 (KB of shared memory for x's stages), "
                             f"not {self.x_stage_kb}")
        if not 2 <= self.ring <= 32:
            raise ValueError(f"ring must hold 2 to 32 slots, not {self.ring}")
        if self.kmax % self.block_k or self.kmax <= 0 or self.kmax & (self.kmax - 1):
            raise ValueError(f"kmax must be a power of two and a multiple of block_k, not {self.kmax}")
        if self.shared_bytes > 220 * 1024:
            raise ValueError(f"ring ({self.ring} x {self.block_rows} x {self.block_k} bf16) and the staged input "
                             f"({self.kmax} floats) need {self.shared_bytes} bytes of shared memory, over 220 KB")

    @property
    def weight_box(self) -> tuple[int, int]:
        """A weight pool's TMA box: half a slot, so a chunk is a tile's two row halves, or a narrow
        tile's two column blocks; with batch_rows, a 128-byte swizzled column block of that
        (SWIZZLE_COLS wide; the loader copies block_k / SWIZZLE_COLS of them a half)."""
        return self.block_rows // 2, SWIZZLE_COLS if self.batch_rows else self.block_k

    @property
    def x_stages(self) -> int:
        """With batch_rows: the [batch_rows, block_k] bf16 blocks of x in flight (cp.async) ahead of
        the mmas, as many as x_stage_kb holds: 2, 4 or 8 (a power of two: the stages are one
        [stages, ...] shared view; 0 without batch_rows)."""
        if not self.batch_rows:
            return 0
        fit = self.x_stage_kb * 1024 // (self.batch_rows * self.block_k * 2)
        return 8 if fit >= 8 else 4 if fit >= 4 else 2

    @property
    def kv_split(self) -> bool:
        """attn_wgmma over head_dim 128: a chunk's keys fill one ring slot and its values the next
        (a slot holds 64 tokens of them, wgmma's M), not one slot the two; at head_dim 64 with
        attn_kv_split, a chunk of 128 tokens the same way (half the chunks, each twice the tokens)."""
        return self.attn_wgmma and (self.head_dim > SWIZZLE_COLS or self.attn_kv_split)

    @property
    def kv_tokens(self) -> int:
        """Context tokens per ring chunk of an attention node (their keys, then their values): a
        slot's [BR, BK] bf16 holds 2 x kv_tokens rows of head_dim (kv_split: kv_tokens rows, the
        values in the next slot), at most 128 tokens."""
        rows = 1 if self.kv_split else 2
        return min(128, self.block_rows * self.block_k // (rows * self.head_dim)) if self.head_dim else 0

    @property
    def kv_width(self) -> int:
        """A KV TMA box's columns: a head's row, or with attn_wgmma a 128-byte swizzled block of it."""
        return min(self.head_dim, SWIZZLE_COLS) if self.attn_wgmma else self.head_dim

    def kv_box(self, block_size: int) -> int:
        """The TMA box's token rows for a cache of `block_size`: a box never crosses a block."""
        if block_size < 1 or block_size & (block_size - 1):
            raise ValueError(f"the streaming executor needs a power-of-two KV block size, not {block_size}")
        if self.attn_wgmma and min(block_size, self.kv_tokens) < 8:
            raise ValueError(f"attn_wgmma needs KV blocks of at least 8 tokens (its TMA boxes are 128-byte swizzled, "
                             f"8 rows a swizzle), not {block_size}")
        return min(block_size, self.kv_tokens)

    @property
    def x_rows(self) -> int:
        """Rows of block_k floats the staged input holds: x for a batch-1 GEMV (kmax), or x_stages
        bf16 blocks of batch_rows rows (half a float row a row)."""
        return max(self.kmax // self.block_k, self.x_stages * self.batch_rows // 2)

    @property
    def shared_bytes(self) -> int:
        """The ring and the staged input (a batch-1 GEMV's x, or a batched kernel's stages of x)."""
        return self.ring * self.block_rows * self.block_k * 2 + self.x_rows * self.block_k * 4

    def constexprs(self) -> dict:
        return dict(BR=self.block_rows, BK=self.block_k, NBUF=self.ring, KMAX=self.kmax, SPIN=self.spin,
                    TRACE=self.trace, HD=self.head_dim,
                    GP=max(8, self.attn_group) if self.attn_wgmma else self.attn_group, AW=self.attn_wgmma,
                    TILE=min(self.attn_tile, self.kv_tokens) if self.head_dim else self.attn_tile,
                    KVT=self.kv_tokens, NB=self.batch_rows, XS=self.x_stages,
                    XR=self.x_rows, TP=self.tensor_parallel, WP=self.wgmma_pipe, TT=self.gemv_tall)


def smem_layout(swizzled: bool = False):
    """The shared layout of a TMA box: plain rows, or 128-byte swizzled (a batched kernel's weight
    boxes, StreamConfig.weight_box; attn_wgmma's KV rows of 64 values)."""
    from triton.experimental.gluon import language as gl
    return gl.NVMMASharedLayout(swizzle_byte_width=128 if swizzled else 0, element_bitwidth=16, rank=2)


def compile_for(cfg: StreamConfig, arch: int = 90, block_size: int = 16):
    """The compiled kernel for sm_`arch`, built without a GPU (attention for a KV cache of
    `block_size`-token blocks)."""
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.runtime.jit import create_function_from_signature

    from warploop.runtime.stream.kernel import stream_kernel

    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(stream_kernel.signature, stream_kernel.params, backend)
    w = torch.zeros(cfg.block_rows * 2, cfg.block_k * 2, dtype=torch.bfloat16)
    d = TensorDescriptor.from_tensor(w, list(cfg.weight_box), smem_layout(bool(cfg.batch_rows)))
    dkv = d
    if cfg.head_dim:                  # a cache of 16-token blocks, 2 KV heads
        cache = torch.zeros(64, 2 * cfg.head_dim, dtype=torch.bfloat16)
        dkv = TensorDescriptor.from_tensor(cache, [cfg.kv_box(block_size), cfg.kv_width], smem_layout(cfg.attn_wgmma))
    i32 = torch.zeros(64, dtype=torch.int32)
    from warploop.runtime.stream.kernel import CW
    kw = dict(cfg.constexprs(), num_warps=CW.value)
    i64 = torch.zeros(64, dtype=torch.int64)
    bf16 = torch.zeros(64, dtype=torch.bfloat16)
    bound, spec, opts = binder(d, d, d, d, dkv, i32, i32, torch.zeros(64), i32, bf16, bf16, i32, i32, 0, 1, i64, i64,
                               **kw)
    opts, sig, constexprs, attrs = stream_kernel._pack_args(backend, kw, bound, spec, opts)
    return triton.compile(GluonASTSource(stream_kernel, sig, constexprs, attrs), target=target,
                          options=opts.__dict__)


def report(ck) -> dict:
    """Shared memory, registers (the launch bound; setmaxnreg then moves them between roles, so the
    roles' own budgets come from the PTX), spill bytes (local memory), stack bytes (registers spilled
    to the stack frame) and the PTX markers of a compiled kernel."""
    import triton
    ptx = ck.asm["ptx"]
    out = {"shared": ck.metadata.shared, "ptx": {m: ptx.count(m) for m in PTX_MARKERS}}
    # setmaxnreg.inc for the default partition (the consumer), .dec for the workers (the loader)
    inc = [int(v) for v in re.findall(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+(\d+)", ptx)]
    dec = [int(v) for v in re.findall(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+(\d+)", ptx)]
    out["roles"] = {"consumer": max(inc, default=None), "loader": min(dec, default=None)}
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    out["n_regs"] = out["spill_bytes"] = out["stack_bytes"] = None
    if os.path.exists(cuobjdump):
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(ck.asm["cubin"])
            f.flush()
            res = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True)
        line = next((ln for ln in res.stdout.splitlines() if "REG:" in ln), "")
        usage = dict(p.split(":", 1) for p in line.split() if ":" in p)
        if usage:
            # local memory (LOCAL), and the stack frame (STACK): with no calls in the kernel, its bytes are
            # registers ptxas spilled too
            out["n_regs"], out["spill_bytes"] = int(usage["REG"]), int(usage.get("LOCAL", 0))
            out["stack_bytes"] = int(usage.get("STACK", 0))
    return out
