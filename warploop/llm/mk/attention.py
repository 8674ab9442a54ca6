"""Attention tile bodies of the decode graph, one KV head group of one batch row per node.

A node's index n names both: batch row n // KVH, KV head group n % KVH (`node_row`), so a batch
of B rows spreads its attention over B x KVH nodes; a node past the live rows does nothing.

rope_kv_node  q/k norm (Qwen3), RoPE for the group's q heads and its k head, in place in qkv,
              and the new token's k and v written into the paged cache at its slot
attn_node     one split of paged decode attention over each sequence's block table: the
              context is cut into S splits at run time (ceil(ctx / S), rounded up to TILE), so
              the graph stays static while long sequences spread over S nodes; each split
              writes its normalised output and log-sum-exp
combine_node  merges a group's S splits per head by their log-sum-exp, in the model's dtype
rope_attn_node  all three for a plan of one split (S = 1): one node per group

Rounding follows the per-op backend of the same device, so greedy tokens agree with it: on the
GPU triton_ops.py and paged_attention.py (float32 RoPE rounded once; p rounded to the cache's
dtype for the PV product), on the CPU layers.py (RoPE in the model dtype, product by product;
torch's SDPA keeps p in float32). An online softmax in float32 either way.
"""
from __future__ import annotations

import triton
import triton.language as tl

from warploop.llm.mk.layout import step_field, step_rows, step_table
from warploop.llm.mk.numerics import mma, rnd
from warploop.runtime.sync import i64


@triton.jit
def node_row(inp, n, KVH: tl.constexpr):
    """(group, first row, end row) of node n: row n // KVH if it is live this step, else an empty range."""
    b = n // KVH
    return n % KVH, b, tl.minimum(b + 1, step_rows(inp))


@triton.jit
def rope_kv_node(inp, qkv, cos, sin, qn, kn, kc, vc, n, eps, has_qk_norm, H: tl.constexpr, KVH: tl.constexpr,
                 HD: tl.constexpr, HDP: tl.constexpr, HALFP: tl.constexpr, GP1: tl.constexpr, BACKEND: tl.constexpr):
    G: tl.constexpr = H // KVH
    HALF: tl.constexpr = HD // 2
    ROW: tl.constexpr = (H + 2 * KVH) * HD
    dt = qkv.dtype.element_ty
    g, b0, b1 = node_row(inp, n, KVH)
    j = tl.arange(0, GP1)                       # the group's q heads, then its k head (j == G)
    head = tl.where(j < G, g * G + j, H + g)
    d = tl.arange(0, HALFP)
    dmask = d < HALF
    m = (j <= G)[:, None] & dmask[None, :]
    for b in range(b0, b1):
        base = qkv + i64(b) * ROW + head[:, None] * HD + d[None, :]
        x1 = tl.load(base, mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(base + HALF, mask=m, other=0.0).to(tl.float32)
        if has_qk_norm != 0:
            is_q = (j < G)[:, None]
            w1 = tl.where(is_q, tl.load(qn + d, mask=dmask, other=0.0)[None, :],
                          tl.load(kn + d, mask=dmask, other=0.0)[None, :]).to(tl.float32)
            w2 = tl.where(is_q, tl.load(qn + HALF + d, mask=dmask, other=0.0)[None, :],
                          tl.load(kn + HALF + d, mask=dmask, other=0.0)[None, :]).to(tl.float32)
            rstd = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / HD + eps)[:, None]
            x1 = rnd(w1 * rnd(x1 * rstd, dt, BACKEND).to(tl.float32), dt, BACKEND).to(tl.float32)
            x2 = rnd(w2 * rnd(x2 * rstd, dt, BACKEND).to(tl.float32), dt, BACKEND).to(tl.float32)
        pos = step_field(inp, 1, b).to(tl.int64)
        c = tl.load(cos + pos * HALF + d, mask=dmask, other=0.0)[None, :]
        s = tl.load(sin + pos * HALF + d, mask=dmask, other=0.0)[None, :]
        if BACKEND == "cpu":   # as layers.py: cos, sin and every product rounded to the model dtype
            c = rnd(c, dt, BACKEND).to(tl.float32)
            s = rnd(s, dt, BACKEND).to(tl.float32)
            o1 = rnd(rnd(x1 * c, dt, BACKEND).to(tl.float32) - rnd(x2 * s, dt, BACKEND).to(tl.float32), dt, BACKEND)
            o2 = rnd(rnd(x2 * c, dt, BACKEND).to(tl.float32) + rnd(x1 * s, dt, BACKEND).to(tl.float32), dt, BACKEND)
        else:                  # as triton_ops.py: float32, one rounding
            o1 = (x1 * c - x2 * s).to(dt)
            o2 = (x2 * c + x1 * s).to(dt)
        tl.store(base, o1, mask=m)
        tl.store(base + HALF, o2, mask=m)
        slot = step_field(inp, 3, b).to(tl.int64)
        if slot >= 0:
            dst = (slot * KVH + g) * HD
            km = (j == G)[:, None] & dmask[None, :]
            kp = kc + dst + 0 * j[:, None] + d[None, :]
            tl.store(kp, o1, mask=km)
            tl.store(kp + HALF, o2, mask=km)
            full = tl.arange(0, HDP)
            v = tl.load(qkv + i64(b) * ROW + (H + KVH + g) * HD + full, mask=full < HD, other=0.0)
            tl.store(vc + dst + full, v, mask=full < HD)


@triton.jit
def attn_node(inp, qkv, kc, vc, parts, lse, n, split, scale, H: tl.constexpr, KVH: tl.constexpr,
              HD: tl.constexpr, HDP: tl.constexpr, GP: tl.constexpr, BS: tl.constexpr, TILE: tl.constexpr,
              S: tl.constexpr, BACKEND: tl.constexpr, DIRECT: tl.constexpr = False):
    """parts[b, h, split, :] and lse[b, h, split] for the group's heads h (-inf: an empty split);
    DIRECT (one split): the output itself into parts = the attention output [b, H * HD], in its dtype."""
    G: tl.constexpr = H // KVH
    ROW: tl.constexpr = (H + 2 * KVH) * HD
    g, b0, b1 = node_row(inp, n, KVH)
    gi = tl.arange(0, GP)
    gm = gi < G
    heads = g * G + gi
    d = tl.arange(0, HDP)
    dm = d < HD
    for b in range(b0, b1):
        ctx = step_field(inp, 2, b)
        per = tl.cdiv(tl.cdiv(ctx, S), TILE) * TILE
        start = split * per
        end = tl.minimum(start + per, ctx)
        q = tl.load(qkv + i64(b) * ROW + heads[:, None] * HD + d[None, :], mask=gm[:, None] & dm[None, :],
                    other=0.0)
        table = step_table(inp, b)
        m = tl.full([GP], float("-inf"), tl.float32)
        acc_l = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, HDP], tl.float32)
        t0 = start
        while t0 < end:   # a while loop: the interpreter runs it over scalar bounds as the GPU does
            toks = t0 + tl.arange(0, TILE)
            valid = toks < end
            blk = tl.load(table + toks // BS, mask=valid, other=0).to(tl.int64)
            offs = ((blk * BS + toks % BS)[:, None] * KVH + g) * HD + d[None, :]
            k = tl.load(kc + offs, mask=valid[:, None] & dm[None, :], other=0.0)
            sc = mma(q, tl.trans(k), BACKEND) * scale
            sc = tl.where(valid[None, :], sc, float("-inf"))
            m_new = tl.maximum(m, tl.max(sc, axis=1))
            p = tl.exp(sc - m_new[:, None])
            alpha = tl.exp(m - m_new)
            v = tl.load(vc + offs, mask=valid[:, None] & dm[None, :], other=0.0)
            if BACKEND == "cpu":     # the per-op CPU path (torch SDPA) keeps p in float32
                pv = mma(p, v, BACKEND)
            else:                    # the per-op GPU kernel (paged_attention.py) rounds p to v's dtype
                pv = mma(p.to(v.dtype), v, BACKEND)
            acc = acc * alpha[:, None] + pv
            acc_l = acc_l * alpha + tl.sum(p, axis=1)
            m = m_new
            t0 += TILE
        row = (i64(b) * H + heads) * S + split
        empty = end <= start
        out = tl.where(empty, 0.0, acc / tl.where(empty, 1.0, acc_l)[:, None])
        if DIRECT:      # what combine_node makes of one split: the same values, rounded once
            tl.store(parts + row[:, None] * HD + d[None, :], rnd(out, parts.dtype.element_ty, BACKEND),
                     mask=gm[:, None] & dm[None, :])
        else:
            tl.store(parts + row[:, None] * HD + d[None, :], out, mask=gm[:, None] & dm[None, :])
            tl.store(lse + row, tl.where(empty, float("-inf"), m + tl.log(tl.where(empty, 1.0, acc_l))), mask=gm)


@triton.jit
def rope_attn_node(inp, qkv, cos, sin, qn, kn, kc, vc, out, n, qk_eps, scale, H: tl.constexpr,
                   KVH: tl.constexpr, HD: tl.constexpr, HDP: tl.constexpr, HALFP: tl.constexpr, GP1: tl.constexpr,
                   GP: tl.constexpr, BS: tl.constexpr, TILE: tl.constexpr, BACKEND: tl.constexpr):
    """A plan of one split: rope_kv_node, attn_node and combine_node of node n as one node, so the
    group's attention is one stage of the graph instead of three. out: the attention output;
    qk_eps: the q/k norm's epsilon, negative for a model without one (a task has 12 arguments)."""
    rope_kv_node(inp, qkv, cos, sin, qn, kn, kc, vc, n, qk_eps, (qk_eps >= 0).to(tl.int32), H, KVH, HD, HDP, HALFP,
                 GP1, BACKEND)
    tl.debug_barrier()      # the roped q and the new token's k and v, written above, are read below
    attn_node(inp, qkv, kc, vc, out, out, n, 0, scale, H, KVH, HD, HDP, GP, BS, TILE, 1, BACKEND, True)


@triton.jit
def combine_node(inp, parts, lse, out, n, H: tl.constexpr, KVH: tl.constexpr, HD: tl.constexpr, HDP: tl.constexpr,
                 S: tl.constexpr, SP: tl.constexpr, BACKEND: tl.constexpr):
    """out[b, h * HD:(h + 1) * HD] for node n's row b and its group's heads h, from their S splits."""
    G: tl.constexpr = H // KVH
    g, b0, b1 = node_row(inp, n, KVH)
    sp = tl.arange(0, SP)
    d = tl.arange(0, HDP)
    dm = d < HD
    for b in range(b0, b1):
        for i in range(G):
            head = g * G + i
            row = (i64(b) * H + head) * S + sp
            ls = tl.load(lse + row, mask=sp < S, other=float("-inf"))
            weight = tl.exp(ls - tl.max(ls, axis=0))
            pv = tl.load(parts + row[:, None] * HD + d[None, :], mask=(sp < S)[:, None] & dm[None, :], other=0.0)
            o = tl.sum(pv * weight[:, None], axis=0) / tl.sum(weight, axis=0)
            tl.store(out + (i64(b) * H + head) * HD + d, rnd(o, out.dtype.element_ty, BACKEND), mask=dm)
