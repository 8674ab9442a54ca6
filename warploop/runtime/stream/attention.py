"""The attention node kinds' bodies for the streaming kernel (kinds.ATTN, kinds.COMBINE), in Gluon.

kernel.py's consumer calls them after the node's waits, with its warp count CW. A KV head's q heads,
its new k and v and a tile of cached keys share one 3-D layout [GP, TILE, HD]: scores are products
summed over HD, the output products summed over TILE, fp32 throughout; k and v are rounded to the
cache's bf16 once, as stored.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from warploop.runtime.stream.kinds import ATTN, COMBINE

OP_ATTN = gl.constexpr(ATTN.opcode)
A = {f.name: gl.constexpr(ATTN.word(f.name)) for f in ATTN.fields}
A_QKV, A_OUT, A_HEAD, A_KVHEAD, A_GROUP = A["qkv"], A["out"], A["head"], A["kvhead"], A["group"]
A_HEADS, A_KVHEADS, A_STEP, A_COS, A_SIN = A["heads"], A["kvheads"], A["step"], A["cos"], A["sin"]
A_QN, A_KN, A_LAYER, A_BLOCKS, A_BS, A_EPS, A_SCALE = A["qn"], A["kn"], A["layer"], A["blocks"], A["bs"], \
    A["eps"], A["scale"]
A_SPLIT, A_SPLITS, A_PART = A["split"], A["splits"], A["part"]
OP_COMBINE = gl.constexpr(COMBINE.opcode)
C_PART, C_OUT, C_HEAD = gl.constexpr(COMBINE.word("part")), gl.constexpr(COMBINE.word("out")), \
    gl.constexpr(COMBINE.word("head"))
C_GROUP, C_SPLITS = gl.constexpr(COMBINE.word("group")), gl.constexpr(COMBINE.word("splits"))


@gluon.jit
def _rope_head(arena, src, d, cs, sn, w, eps, NORM, HD: gl.constexpr):
    """Rows src[j] (arena offsets of heads, [R] tensor) RMS-normed by w (when NORM) and rotated by
    the RoPE rows cs, sn ([HD], the half-rows repeated): the halves convention, x * cos + rot(x) * sin
    with rot(x) = (-x2, x1)."""
    HALF: gl.constexpr = HD // 2
    dp = gl.where(d < HALF, d + HALF, d - HALF)
    sign = gl.where(d < HALF, -1.0, 1.0)
    x = gl.load(arena + src[:, None] + d[None, :])
    xp = gl.load(arena + src[:, None] + dp[None, :])
    if NORM:
        r = gl.rsqrt(gl.sum(x * x, axis=1) / HD + eps)[:, None]
        x = x * r * gl.load(arena + w + d)[None, :]
        xp = xp * r * gl.load(arena + w + dp)[None, :]
    return x * cs[None, :] + sign[None, :] * xp * sn[None, :]


@gluon.jit
def attn(arena, ints, kv, base, CW: gl.constexpr, HD: gl.constexpr, GP: gl.constexpr, TILE: gl.constexpr):
    """The ATTN kind's body (kinds.ATTN), after its waits. fp32 throughout; k and v rounded to the
    cache's bf16 once, as stored, and used in that form for the new token too."""
    HALF: gl.constexpr = HD // 2
    L3: gl.constexpr = gl.BlockedLayout([1, 1, 8], [1, 32 // (HD // 8), HD // 8], [1, CW, 1], [2, 1, 0])
    QL: gl.constexpr = gl.SliceLayout(1, L3)          # [GP, HD]: q heads, the output
    KL: gl.constexpr = gl.SliceLayout(0, L3)          # [TILE, HD]: a tile of keys or values
    SL: gl.constexpr = gl.SliceLayout(2, L3)          # [GP, TILE]: scores
    qkv = gl.load(base + A_QKV)
    out = gl.load(base + A_OUT)
    head0 = gl.load(base + A_HEAD)
    g = gl.load(base + A_KVHEAD)
    grp = gl.load(base + A_GROUP)
    heads = gl.load(base + A_HEADS)
    kvh = gl.load(base + A_KVHEADS)
    step = gl.load(base + A_STEP)
    cos_t = gl.load(base + A_COS)
    sin_t = gl.load(base + A_SIN)
    qn = gl.load(base + A_QN)
    kn = gl.load(base + A_KN)
    layer = gl.load(base + A_LAYER)
    blocks = gl.load(base + A_BLOCKS)
    bs = gl.load(base + A_BS)
    eps = gl.load(base + A_EPS).to(gl.float32, bitcast=True)
    scale = gl.load(base + A_SCALE).to(gl.float32, bitcast=True)
    split = gl.load(base + A_SPLIT)
    splits = gl.load(base + A_SPLITS)
    part = gl.load(base + A_PART)
    pos = gl.load(ints + step)
    n_ctx = gl.load(ints + step + 1)
    slot = gl.load(ints + step + 2)
    # this split's tokens [lo, hi): whole tiles, the last split takes what is left
    chunk = ((n_ctx + splits - 1) // splits + TILE - 1) // TILE * TILE
    lo = gl.minimum(split * chunk, n_ctx)
    hi = gl.minimum(lo + chunk, n_ctx)
    row_words = (kvh * HD).to(gl.int64)
    kc = kv + layer.to(gl.int64) * 2 * blocks * bs * row_words
    vc = kc + blocks.to(gl.int64) * bs * row_words
    # q heads of the group, in the scores' row layout
    dq = gl.arange(0, HD, layout=gl.SliceLayout(0, QL))
    jq = gl.arange(0, GP, layout=gl.SliceLayout(1, QL))
    jq = gl.minimum(jq, grp - 1)                       # padded rows repeat the last head (not stored)
    csq = gl.load(arena + cos_t + pos * HALF + dq % HALF)
    snq = gl.load(arena + sin_t + pos * HALF + dq % HALF)
    q = _rope_head(arena, qkv + (head0 + jq) * HD, dq, csq, snq, qn, eps, qn >= 0, HD)
    # the new token's k and v, in a tile's layout (row 0 of a [1, HD] tile)
    dk = gl.arange(0, HD, layout=gl.SliceLayout(0, KL))
    one = gl.arange(0, 1, layout=gl.SliceLayout(1, KL))
    csk = gl.load(arena + cos_t + pos * HALF + dk % HALF)
    snk = gl.load(arena + sin_t + pos * HALF + dk % HALF)
    knew = _rope_head(arena, qkv + (heads + g) * HD + one, dk, csk, snk, kn, eps, kn >= 0, HD)
    knew = knew.to(gl.bfloat16)
    vnew = gl.load(arena + qkv + (heads + kvh + g) * HD + one[:, None] + dk[None, :]).to(gl.bfloat16)
    if (slot >= 0) & (lo <= n_ctx - 1) & (n_ctx - 1 < hi):     # the split holding the new token
        dst = slot.to(gl.int64) * row_words + g * HD + one[:, None] + dk[None, :]
        gl.store(kc + dst, knew)
        gl.store(vc + dst, vnew)
    knew = knew.to(gl.float32)
    vnew = vnew.to(gl.float32)
    tk = gl.arange(0, TILE, layout=gl.SliceLayout(1, KL))
    m_i = gl.full([GP], float("-inf"), gl.float32, layout=gl.SliceLayout(1, SL))
    l_i = gl.zeros([GP], gl.float32, layout=gl.SliceLayout(1, SL))
    acc = gl.zeros([GP, HD], gl.float32, layout=QL)
    ts = gl.arange(0, TILE, layout=gl.SliceLayout(0, SL))
    t0 = lo
    while t0 < hi:
        toks = t0 + tk
        live = toks < hi
        blk = gl.load(ints + step + 3 + toks // bs, mask=live, other=0)
        rows = (blk.to(gl.int64) * bs + toks % bs) * row_words + g * HD
        addr = rows[:, None] + dk[None, :]
        m2 = live[:, None]
        kt = gl.load(kc + addr, mask=m2, other=0.0).to(gl.float32)
        vt = gl.load(vc + addr, mask=m2, other=0.0).to(gl.float32)
        new = (toks == n_ctx - 1)[:, None]
        kt = gl.where(new, knew, kt)
        vt = gl.where(new, vnew, vt)
        sc = gl.sum(q[:, None, :] * kt[None, :, :], axis=2) * scale
        sc = gl.where((t0 + ts < hi)[None, :], sc, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(sc, axis=1))
        p = gl.exp(sc - m_new[:, None])
        alpha = gl.exp(m_i - m_new)
        l_i = l_i * alpha + gl.sum(p, axis=1)
        a_q = gl.convert_layout(alpha, gl.SliceLayout(1, QL))
        acc = acc * a_q[:, None] + gl.sum(p[:, :, None] * vt[None, :, :], axis=1)
        m_i = m_new
        t0 += TILE
    jo = gl.arange(0, GP, layout=gl.SliceLayout(1, QL))
    if splits == 1:
        o = acc / gl.convert_layout(l_i, gl.SliceLayout(1, QL))[:, None]
        gl.store(arena + out + (head0 + jo)[:, None] * HD + dq[None, :], o, mask=(jo < grp)[:, None])
    else:
        pb = arena + part + split * grp * (HD + 2)
        gl.store(pb + jo[:, None] * HD + dq[None, :], acc, mask=(jo < grp)[:, None])
        js = gl.arange(0, GP, layout=gl.SliceLayout(1, SL))
        gl.store(pb + grp * HD + js, m_i, mask=js < grp)
        gl.store(pb + grp * HD + grp + js, l_i, mask=js < grp)


@gluon.jit
def combine(arena, base, CW: gl.constexpr, HD: gl.constexpr, GP: gl.constexpr):
    """The COMBINE kind's body: out = sum_s acc_s e^(m_s - M) / sum_s l_s e^(m_s - M), M = max_s m_s."""
    L3: gl.constexpr = gl.BlockedLayout([1, 1, 8], [1, 32 // (HD // 8), HD // 8], [1, CW, 1], [2, 1, 0])
    QL: gl.constexpr = gl.SliceLayout(1, L3)
    part = gl.load(base + C_PART)
    out = gl.load(base + C_OUT)
    head0 = gl.load(base + C_HEAD)
    grp = gl.load(base + C_GROUP)
    splits = gl.load(base + C_SPLITS)
    j = gl.arange(0, GP, layout=gl.SliceLayout(1, QL))
    jm = gl.minimum(j, grp - 1)
    d = gl.arange(0, HD, layout=gl.SliceLayout(0, QL))
    stride = grp * (HD + 2)
    big = gl.full([GP], float("-inf"), gl.float32, layout=gl.SliceLayout(1, QL))
    for s in range(splits):
        big = gl.maximum(big, gl.load(arena + part + s * stride + grp * HD + jm, cache_modifier=".cg"))
    num = gl.zeros([GP, HD], gl.float32, layout=QL)
    den = gl.zeros([GP], gl.float32, layout=gl.SliceLayout(1, QL))
    for s in range(splits):
        pb = arena + part + s * stride
        w = gl.exp(gl.load(pb + grp * HD + jm, cache_modifier=".cg") - big)
        den += w * gl.load(pb + grp * HD + grp + jm, cache_modifier=".cg")
        num += w[:, None] * gl.load(pb + jm[:, None] * HD + d[None, :], cache_modifier=".cg")
    gl.store(arena + out + (head0 + j)[:, None] * HD + d[None, :], num / den[:, None], mask=(j < grp)[:, None])
