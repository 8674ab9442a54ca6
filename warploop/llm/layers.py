"""The model's operations in plain PyTorch: the CPU path, and the reference the Triton kernels are
tested against. Rounding follows transformers (norms in float32, products in the model's dtype) so
float32 logits match it closely.

KV cache tensors here are one layer's k or v: [num_blocks, block_size, num_kv_heads, head_dim].
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

# SDPA's backends for prefill on a GPU (torch.nn.attention.SDPBackend names), None: torch's choice.
# `warploop bench prefill` measures each choice's first prefill of an unseen prompt length
SDPA_BACKENDS: tuple[str, ...] | None = None


def _sdpa_choice(device: torch.device):
    if SDPA_BACKENDS is None or device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel([getattr(SDPBackend, name) for name in SDPA_BACKENDS])


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual) * weight, x + residual): the residual add fused in front of the norm."""
    if residual is not None:
        x = x + residual
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype), x


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def qk_rope_cache(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, num_heads: int,
                  num_kv_heads: int, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None,
                  eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split qkv [T, (H + 2 KV) * D], apply q/k norms and RoPE, store k and v at `slots` (slots < 0
    are padding and stored nowhere). Returns q [T, H, D], k and v [T, KV, D]."""
    t = qkv.shape[0]
    d = k_cache.shape[-1]
    q, k, v = qkv.split([num_heads * d, num_kv_heads * d, num_kv_heads * d], dim=-1)
    q, k, v = q.reshape(t, num_heads, d), k.reshape(t, num_kv_heads, d), v.reshape(t, num_kv_heads, d)
    if q_norm is not None:
        q, _ = rms_norm(q, q_norm, eps)
        k, _ = rms_norm(k, k_norm, eps)
    pos = positions.long()
    c = torch.cat((cos[pos], cos[pos]), dim=-1)[:, None, :].to(q.dtype)
    s = torch.cat((sin[pos], sin[pos]), dim=-1)[:, None, :].to(q.dtype)
    q, k = _rotate(q, c, s), _rotate(k, c, s)
    keep = slots >= 0
    if not bool(keep.all()):
        slots, k_store, v_store = slots[keep], k[keep], v[keep]
    else:
        k_store, v_store = k, v
    k_cache.view(-1, num_kv_heads, d).index_copy_(0, slots.long(), k_store)
    v_cache.view(-1, num_kv_heads, d).index_copy_(0, slots.long(), v_store)
    return q, k, v


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _gather(cache: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """[B, W] block tables -> [B, W * block_size, KV, D]: the context read straight from the pages."""
    b, w = tables.shape
    bs = cache.shape[1]
    slots = (tables.long()[:, :, None] * bs + torch.arange(bs, device=tables.device)).reshape(b, w * bs)
    return cache.view(-1, *cache.shape[2:])[slots]


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """One query token per sequence: q [B, H, D] over its paged context -> [B, H * D]."""
    b, h, d = q.shape
    k, v = _gather(k_cache, block_tables), _gather(v_cache, block_tables)
    mask = torch.arange(k.shape[1], device=q.device)[None, :] < context_lens[:, None]
    out = F.scaled_dot_product_attention(q[:, :, None, :], k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=True)
    return out.reshape(b, h * d)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, block_tables: list[torch.Tensor], query_lens: list[int],
                      context_lens: list[int], scale: float) -> torch.Tensor:
    """Causal attention for each sequence's new tokens. A sequence with no cached prefix attends
    over its fresh k and v; one whose prefix came from the cache reads its context from the pages."""
    outs, start = [], 0
    for table, qlen, clen in zip(block_tables, query_lens, context_lens, strict=True):
        qs = q[start:start + qlen].transpose(0, 1)[None]
        if qlen == clen:
            ks, vs = k[start:start + qlen], v[start:start + qlen]
            mask, causal = None, True
        else:
            ks, vs = _gather(k_cache, table[None])[0, :clen], _gather(v_cache, table[None])[0, :clen]
            rows = torch.arange(clen - qlen, clen, device=q.device)[:, None]
            mask, causal = torch.arange(clen, device=q.device)[None, :] <= rows, False
        with _sdpa_choice(q.device):
            o = F.scaled_dot_product_attention(qs, ks.transpose(0, 1)[None], vs.transpose(0, 1)[None],
                                               attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True)
        outs.append(o[0].transpose(0, 1).reshape(qlen, -1))
        start += qlen
    return torch.cat(outs) if len(outs) > 1 else outs[0]
