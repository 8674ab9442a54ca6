"""Fused kernels for the GPU path, with the same signatures and rounding as the PyTorch versions in
layers.py, which the tests compare them against (TRITON_INTERPRET=1 on CPU).

They exist to cut launches in the decode step: residual add + RMSNorm in one kernel, q/k norm +
RoPE + KV-cache store in one, SiLU * up in one. The kernels are in ops_kernels.py; ops_prebuilt
launches them from the bundle the package ships, or through Triton's JIT where it does not fit.
Importing this module imports no Triton.
"""
from __future__ import annotations

import torch

from warploop.llm.ops_prebuilt import launch

# as ops_kernels.py exports them (tests/test_ops_prebuilt.py checks it)
ROW_BLOCKS = (1024, 2048, 4096, 8192)    # rms_norm: the narrowest that holds the row; the widest loops
SILU_BLOCK = 1024


def row_block(cols: int) -> int:
    return next((b for b in ROW_BLOCKS if b >= cols), ROW_BLOCKS[-1])


def row_warps(block: int) -> int:
    return min(max(block // 256, 1), 8)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Like layers.rms_norm; the new residual (x + residual) is written into `residual` in place."""
    assert x.is_contiguous() and x.dim() == 2, "rms_norm wants a contiguous [rows, cols] tensor"
    rows, cols = x.shape
    out = torch.empty_like(x)
    has_res = residual is not None
    if has_res:
        assert residual.shape == x.shape and residual.is_contiguous() and residual.dtype == x.dtype
    block = row_block(cols)
    launch("rms_norm_kernel", (rows,), (x, residual if has_res else x, weight, out, cols, eps),
           {"HAS_RES": has_res, "BLOCK": block}, num_warps=row_warps(block))
    return out, (residual if has_res else x)


def qk_rope_cache(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, num_heads: int,
                  num_kv_heads: int, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None,
                  eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Like layers.qk_rope_cache; q and k are rotated in place inside `qkv`."""
    t = qkv.shape[0]
    d = k_cache.shape[-1]
    assert qkv.is_contiguous() and qkv.shape[1] == (num_heads + 2 * num_kv_heads) * d
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.dtype == qkv.dtype
    assert cos.dtype == torch.float32 and cos.shape[1] == d // 2 and cos.is_contiguous()
    has_norm = q_norm is not None
    launch("qk_rope_cache_kernel", (t, num_heads + num_kv_heads),
           (qkv, positions, cos, sin, slots, k_cache, v_cache, q_norm if has_norm else qkv,
            k_norm if has_norm else qkv, eps, num_heads, num_kv_heads),
           {"HEAD_DIM": d, "HAS_QK_NORM": has_norm})
    q, k, v = qkv.split([num_heads * d, num_kv_heads * d, num_kv_heads * d], dim=-1)
    return q.view(t, num_heads, d), k.view(t, num_kv_heads, d), v.view(t, num_kv_heads, d)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    assert gate_up.is_contiguous() and gate_up.dim() == 2
    rows, n = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((rows, n), dtype=gate_up.dtype, device=gate_up.device)
    launch("silu_mul_kernel", (rows, -(n // -SILU_BLOCK)), (gate_up, out, n), {"BLOCK": SILU_BLOCK})
    return out
