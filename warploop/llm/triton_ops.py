"""Fused Triton kernels for the GPU path, each beside its wrapper; same signatures and rounding as
the PyTorch versions in layers.py, which the tests compare them against (TRITON_INTERPRET=1 on CPU).

They exist to cut launches in the decode step: residual add + RMSNorm in one kernel, q/k norm +
RoPE + KV-cache store in one, SiLU * up in one.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, n_cols, eps, HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0)
    if HAS_RES:
        # transformers adds the residual in the model's dtype, then normalises the rounded sum
        r = tl.load(res_ptr + row * n_cols + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(res_ptr + row * n_cols + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    normed = (xf * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * n_cols + cols, w * normed, mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Like layers.rms_norm; the new residual (x + residual) is written into `residual` in place."""
    assert x.is_contiguous() and x.dim() == 2, "rms_norm wants a contiguous [rows, cols] tensor"
    rows, cols = x.shape
    out = torch.empty_like(x)
    if residual is not None:
        assert residual.shape == x.shape and residual.is_contiguous() and residual.dtype == x.dtype
    _rms_norm_kernel[(rows,)](x, residual if residual is not None else x, weight, out, cols, eps,
                              HAS_RES=residual is not None, BLOCK=triton.next_power_of_2(cols))
    return out, (residual if residual is not None else x)


@triton.jit
def _qk_rope_cache_kernel(qkv_ptr, pos_ptr, cos_ptr, sin_ptr, slot_ptr, k_cache_ptr, v_cache_ptr, qn_ptr, kn_ptr,
                          eps, NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                          HAS_QK_NORM: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)          # q heads, then k heads (they are adjacent in qkv)
    HALF: tl.constexpr = HEAD_DIM // 2
    row_len: tl.constexpr = (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM
    d = tl.arange(0, HALF)
    base = qkv_ptr + tok * row_len + head * HEAD_DIM
    x1 = tl.load(base + d).to(tl.float32)
    x2 = tl.load(base + HALF + d).to(tl.float32)
    if HAS_QK_NORM:
        is_q = head < NUM_HEADS
        w1 = tl.where(is_q, tl.load(qn_ptr + d), tl.load(kn_ptr + d)).to(tl.float32)
        w2 = tl.where(is_q, tl.load(qn_ptr + HALF + d), tl.load(kn_ptr + HALF + d)).to(tl.float32)
        rstd = tl.rsqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / HEAD_DIM + eps)
        dt = qkv_ptr.dtype.element_ty
        x1 = (w1 * (x1 * rstd).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        x2 = (w2 * (x2 * rstd).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    c = tl.load(cos_ptr + pos * HALF + d)
    s = tl.load(sin_ptr + pos * HALF + d)
    o1 = x1 * c - x2 * s
    o2 = x2 * c + x1 * s
    tl.store(base + d, o1)
    tl.store(base + HALF + d, o2)
    if head >= NUM_HEADS:
        slot = tl.load(slot_ptr + tok).to(tl.int64)
        if slot >= 0:
            kv_head = head - NUM_HEADS
            dst = (slot * NUM_KV_HEADS + kv_head) * HEAD_DIM
            tl.store(k_cache_ptr + dst + d, o1)
            tl.store(k_cache_ptr + dst + HALF + d, o2)
            full = tl.arange(0, HEAD_DIM)
            v = tl.load(qkv_ptr + tok * row_len + (NUM_HEADS + NUM_KV_HEADS + kv_head) * HEAD_DIM + full)
            tl.store(v_cache_ptr + dst + full, v)


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
    _qk_rope_cache_kernel[(t, num_heads + num_kv_heads)](
        qkv, positions, cos, sin, slots, k_cache, v_cache, q_norm if has_norm else qkv, k_norm if has_norm else qkv,
        eps, NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=d, HAS_QK_NORM=has_norm)
    q, k, v = qkv.split([num_heads * d, num_kv_heads * d, num_kv_heads * d], dim=-1)
    return q.view(t, num_heads, d), k.view(t, num_kv_heads, d), v.view(t, num_kv_heads, d)


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(gu_ptr + row * 2 * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * 2 * n_cols + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    # transformers rounds silu(g) to the model dtype before the product
    act = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * n_cols + cols, act * u, mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    assert gate_up.is_contiguous() and gate_up.dim() == 2
    rows, n = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((rows, n), dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _silu_mul_kernel[(rows, triton.cdiv(n, block))](gate_up, out, n, BLOCK=block)
    return out

