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
rope_attn_node  all three in one node per group (short contexts), its cached context read
              before the node waits, this step's q, k and v kept in registers

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
from warploop.runtime import device as wl
from warploop.runtime.sync import i64


@triton.jit
def node_row(inp, n, KVH: tl.constexpr):
    """(group, first row, end row) of node n: row n // KVH if it is live this step, else an empty range."""
    b = n // KVH
    return n % KVH, b, tl.minimum(b + 1, step_rows(inp))


@triton.jit
def qk_norm_weights(qn, kn, d, dmask, is_q, HALF: tl.constexpr):
    """The q/k RMSNorm weights (Qwen3) as halves over a group's rows: q's for the q heads, k's for the k head."""
    w1 = tl.where(is_q, tl.load(qn + d, mask=dmask, other=0.0)[None, :],
                  tl.load(kn + d, mask=dmask, other=0.0)[None, :]).to(tl.float32)
    w2 = tl.where(is_q, tl.load(qn + HALF + d, mask=dmask, other=0.0)[None, :],
                  tl.load(kn + HALF + d, mask=dmask, other=0.0)[None, :]).to(tl.float32)
    return w1, w2


@triton.jit
def norm_rope(x1, x2, w1, w2, eps, c, s, NORM, HD: tl.constexpr, dt: tl.constexpr, BACKEND: tl.constexpr):
    """The halves x1, x2 (float32) of a group's q and k heads, q/k-normed where NORM, then rotated by
    the RoPE rows c, s: (o1, o2) in dtype dt. Rounding as the per-op backend of the same device: on
    the CPU layers.py (cos, sin and every product rounded to the model dtype), on the GPU
    triton_ops.py (float32, one rounding)."""
    if NORM:
        rstd = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / HD + eps)[:, None]
        x1 = rnd(w1 * rnd(x1 * rstd, dt, BACKEND).to(tl.float32), dt, BACKEND).to(tl.float32)
        x2 = rnd(w2 * rnd(x2 * rstd, dt, BACKEND).to(tl.float32), dt, BACKEND).to(tl.float32)
    if BACKEND == "cpu":
        c = rnd(c, dt, BACKEND).to(tl.float32)
        s = rnd(s, dt, BACKEND).to(tl.float32)
        o1 = rnd(rnd(x1 * c, dt, BACKEND).to(tl.float32) - rnd(x2 * s, dt, BACKEND).to(tl.float32), dt, BACKEND)
        o2 = rnd(rnd(x2 * c, dt, BACKEND).to(tl.float32) + rnd(x1 * s, dt, BACKEND).to(tl.float32), dt, BACKEND)
    else:
        o1 = (x1 * c - x2 * s).to(dt)
        o2 = (x2 * c + x1 * s).to(dt)
    return o1, o2


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
        w1, w2 = x1, x2                         # unused without a q/k norm
        if has_qk_norm != 0:
            w1, w2 = qk_norm_weights(qn, kn, d, dmask, (j < G)[:, None], HALF)
        pos = step_field(inp, 1, b).to(tl.int64)
        c = tl.load(cos + pos * HALF + d, mask=dmask, other=0.0)[None, :]
        s = tl.load(sin + pos * HALF + d, mask=dmask, other=0.0)[None, :]
        o1, o2 = norm_rope(x1, x2, w1, w2, eps, c, s, has_qk_norm != 0, HD, dt, BACKEND)
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
def _cached_halves(kc, vc, table, t0, n_old, g, live, KVH: tl.constexpr, HD: tl.constexpr, HALF: tl.constexpr,
                   HALFP: tl.constexpr, BS: tl.constexpr, TILE: tl.constexpr):
    """Tokens [t0, t0 + TILE) of the cached context below n_old (the tokens before this step's), for
    head group g: k and v as first and second halves of the head, [TILE, HALFP] each (0 elsewhere)."""
    toks = t0 + tl.arange(0, TILE)
    d = tl.arange(0, HALFP)
    old = (toks < n_old) & live
    blk = tl.load(table + toks // BS, mask=old, other=0).to(tl.int64)
    offs = ((blk * BS + toks % BS)[:, None] * KVH + g) * HD + d[None, :]
    m = old[:, None] & (d < HALF)[None, :]
    return (tl.load(kc + offs, mask=m, other=0.0), tl.load(kc + offs + HALF, mask=m, other=0.0),
            tl.load(vc + offs, mask=m, other=0.0), tl.load(vc + offs + HALF, mask=m, other=0.0))


@triton.jit
def _whole(a, b):
    """Halves a, b [R, HALFP] of heads as one [R, 2 * HALFP] operand: the head itself when HALFP is
    half the head (a power-of-two dim), so one dot over it sums as attn_node's does."""
    R: tl.constexpr = a.shape[0]
    W: tl.constexpr = 2 * a.shape[1]
    return tl.reshape(tl.permute(tl.join(a, b), (0, 2, 1)), (R, W))


@triton.jit
def _row(x, j, which):
    """Row `which` of a [GP1, HALFP] block as a [HALFP] vector (a compile-time shape: a masked sum)."""
    return tl.sum(tl.where((j == which)[:, None], x.to(tl.float32), 0.0), axis=0)


@triton.jit
def rope_attn_node(ctx, inp, qkv, cos, sin, qn, kn, kc, vc, out, n, qk_eps, scale, H: tl.constexpr,
                   KVH: tl.constexpr, HD: tl.constexpr, HDP: tl.constexpr, HALFP: tl.constexpr, GP1: tl.constexpr,
                   GP: tl.constexpr, BS: tl.constexpr, TILE: tl.constexpr, BACKEND: tl.constexpr):
    """What rope_kv_node, attn_node (one split) and combine_node compute for node n, as one node and
    one stage of the graph (short contexts). out: the attention output; qk_eps: the q/k norm's
    epsilon, negative for a model without one (a task has 12 arguments).

    Everything no predecessor writes is read before `wl.wait`: the step's fields, the RoPE rows,
    the q/k norm weights, the block table and the first TILE tokens of the cached context (the
    tokens before this step's). After it, only this step's q, k and v are read (from qkv). They
    stay in registers as the halves RoPE works in, joined into whole heads for the scores' one dot
    (so they sum as attn_node's do); the new token's k and v are patched into the cached tile from registers (and
    written to the cache for later steps), and the output is made half by half. Rounding as
    rope_kv_node and attn_node: q and k rounded to the model dtype after RoPE, p to v's dtype
    for the PV product on a GPU, an online softmax in float32."""
    G: tl.constexpr = H // KVH
    HALF: tl.constexpr = HD // 2
    ROW: tl.constexpr = (H + 2 * KVH) * HD
    dt = qkv.dtype.element_ty
    g, b, b1 = node_row(inp, n, KVH)
    live = b < b1
    j = tl.arange(0, GP1)                       # the group's q heads, then its k head (j == G)
    head = tl.where(j < G, g * G + j, H + g)
    d = tl.arange(0, HALFP)
    dmask = d < HALF
    m = (j <= G)[:, None] & dmask[None, :] & live
    # -- before the wait: the step's inputs, RoPE rows, norm weights and the cached context
    pos = step_field(inp, 1, b).to(tl.int64)
    n_ctx = tl.where(live, step_field(inp, 2, b), 0)
    slot = step_field(inp, 3, b).to(tl.int64)
    c = tl.load(cos + pos * HALF + d, mask=dmask & live, other=0.0)[None, :]
    s = tl.load(sin + pos * HALF + d, mask=dmask & live, other=0.0)[None, :]
    is_q = (j < G)[:, None]
    w1 = tl.zeros([GP1, HALFP], tl.float32)
    w2 = tl.zeros([GP1, HALFP], tl.float32)
    if qk_eps >= 0:
        w1, w2 = qk_norm_weights(qn, kn, d, dmask, is_q, HALF)
    table = step_table(inp, b)
    k1, k2, v1, v2 = _cached_halves(kc, vc, table, 0, n_ctx - 1, g, live, KVH, HD, HALF, HALFP, BS, TILE)
    wl.wait(ctx, BACKEND)
    # -- after it: this step's q, k (the group's rows of qkv) and v
    base = qkv + i64(b) * ROW + head[:, None] * HD + d[None, :]
    x1 = tl.load(base, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF, mask=m, other=0.0).to(tl.float32)
    vrow = qkv + i64(b) * ROW + (H + KVH + g) * HD + d
    nv1 = tl.load(vrow, mask=dmask & live, other=0.0)
    nv2 = tl.load(vrow + HALF, mask=dmask & live, other=0.0)
    o1, o2 = norm_rope(x1, x2, w1, w2, qk_eps, c, s, qk_eps >= 0, HD, dt, BACKEND)
    # the new token's k and v: into the cache for later steps, and into the tile from registers
    nk1 = _row(o1, j, G).to(dt)
    nk2 = _row(o2, j, G).to(dt)
    if live & (slot >= 0):
        dst = (slot * KVH + g) * HD
        tl.store(kc + dst + d, nk1, mask=dmask)
        tl.store(kc + dst + HALF + d, nk2, mask=dmask)
        tl.store(vc + dst + d, nv1, mask=dmask)
        tl.store(vc + dst + HALF + d, nv2, mask=dmask)
    q1 = tl.where(is_q, o1, 0.0).to(dt)
    q2 = tl.where(is_q, o2, 0.0).to(dt)
    q = _whole(q1, q2)
    mx = tl.full([GP1], float("-inf"), tl.float32)
    acc_l = tl.zeros([GP1], tl.float32)
    acc1 = tl.zeros([GP1, HALFP], tl.float32)
    acc2 = tl.zeros([GP1, HALFP], tl.float32)
    t0 = 0
    while t0 < n_ctx:   # a while loop: the interpreter runs it over scalar bounds as the GPU does
        toks = t0 + tl.arange(0, TILE)
        new = (toks == n_ctx - 1)[:, None]
        k1 = tl.where(new, nk1[None, :], k1)
        k2 = tl.where(new, nk2[None, :], k2)
        v1 = tl.where(new, nv1[None, :], v1)
        v2 = tl.where(new, nv2[None, :], v2)
        sc = mma(q, tl.trans(_whole(k1, k2)), BACKEND) * scale
        sc = tl.where((toks < n_ctx)[None, :], sc, float("-inf"))
        m_new = tl.maximum(mx, tl.max(sc, axis=1))
        p = tl.exp(sc - m_new[:, None])
        alpha = tl.exp(mx - m_new)
        if BACKEND == "cpu":     # the per-op CPU path (torch SDPA) keeps p in float32
            acc1 = acc1 * alpha[:, None] + mma(p, v1, BACKEND)
            acc2 = acc2 * alpha[:, None] + mma(p, v2, BACKEND)
        else:                    # the per-op GPU kernel (paged_attention.py) rounds p to v's dtype
            acc1 = acc1 * alpha[:, None] + mma(p.to(v1.dtype), v1, BACKEND)
            acc2 = acc2 * alpha[:, None] + mma(p.to(v2.dtype), v2, BACKEND)
        acc_l = acc_l * alpha + tl.sum(p, axis=1)
        mx = m_new
        t0 += TILE
        k1, k2, v1, v2 = _cached_halves(kc, vc, table, t0, n_ctx - 1, g, live, KVH, HD, HALF, HALFP, BS, TILE)
    dst = out + i64(b) * H * HD + (g * G + j)[:, None] * HD + d[None, :]
    om = is_q & dmask[None, :] & live
    norm = tl.where(acc_l > 0, acc_l, 1.0)[:, None]     # 0 only in rows that store nothing
    tl.store(dst, rnd(acc1 / norm, dt, BACKEND), mask=om)
    tl.store(dst + HALF, rnd(acc2 / norm, dt, BACKEND), mask=om)


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
