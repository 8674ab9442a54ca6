"""The rows an attention share reads (attention.py): where this launch's rows lie in the paged
cache, how they are patched over the ring's stale copies, and a head's RMS norm and rotation
(RoPE)."""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

# a ring chunk of keys and values as the loader's TMA wrote it: plain rows (the ring's own layout is
# 128-byte swizzled in a batched kernel, for its weight chunks)
KV_LAYOUT = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2))


@gluon.jit
def fresh_rows(ints, step, bs, toks, f0, f1, fresh, row_words, g, HD: gl.constexpr):
    """Element offsets, in a layer's k (or v) cache, of KV head g's rows for tokens `toks`, and
    which of them are in [f0, f1) (none unless `fresh`)."""
    live = fresh & (toks >= f0) & (toks < f1)
    blk = gl.load(ints + step + 3 + toks // bs, mask=live, other=0)
    return (blk.to(gl.int64) * bs + toks % bs) * row_words + g * HD, live


@gluon.jit
def patch_rows(chunk, t0, ca, cb, row_a, in_a, row_b, in_b, ints, step, bs, f0, f1, fresh, row_words, g, kc,
               vc, rf, df, FL: gl.constexpr, HD: gl.constexpr, KVT: gl.constexpr):
    """Write over the ring's chunk of keys and values at token t0 the rows this launch wrote, which
    TMA may have read before them (in a `stale` chunk: one round trip to the cache in L2, their
    offsets found before the waits for the chunks at ca and cb). rf, df: the chunk's rows and head
    dims in FL."""
    if t0 == ca:
        rows_f, in_f = row_a, in_a
    elif t0 == cb:
        rows_f, in_f = row_b, in_b
    else:                             # a chunk between the first and the last (more steps than a chunk)
        rows_f, in_f = fresh_rows(ints, step, bs, t0 + rf, f0, f1, fresh, row_words, g, HD)
    m2 = in_f[:, None]                # none past [f0, f1), so none in a chunk that is not stale
    at = rows_f[:, None] + df[None, :]
    k_f = gl.load(kc + at, mask=m2, other=0.0, cache_modifier=".cg")
    v_f = gl.load(vc + at, mask=m2, other=0.0, cache_modifier=".cg")
    k_r = chunk.slice(0, KVT).load(FL)
    v_r = chunk.slice(KVT, KVT).load(FL)
    chunk.slice(0, KVT).store(gl.where(m2, k_f, k_r))
    chunk.slice(KVT, KVT).store(gl.where(m2, v_f, v_r))


@gluon.jit
def patch_block(block, cache, t0, ca, cb, row_a, in_a, row_b, in_b, ints, step, bs, f0, f1, fresh, row_words, g, rf, df,
                FL: gl.constexpr, HD: gl.constexpr):
    """patch_rows for one column block of a kv_split slot (StreamConfig.kv_split): block [KVT, KW]
    of the keys' or the values' slot, cache their cache offset by the block's first column."""
    if t0 == ca:
        rows_f, in_f = row_a, in_a
    elif t0 == cb:
        rows_f, in_f = row_b, in_b
    else:
        rows_f, in_f = fresh_rows(ints, step, bs, t0 + rf, f0, f1, fresh, row_words, g, HD)
    m2 = in_f[:, None]
    got = gl.load(cache + rows_f[:, None] + df[None, :], mask=m2, other=0.0, cache_modifier=".cg")
    block.store(gl.where(m2, got, block.load(FL)))


@gluon.jit
def patch_slot(slot, cache, nrow, stale, fix, new, hi, t0, ca, cb, row_a, in_a, row_b, in_b, ints, step, bs, f0, f1,
               fresh, row_words, g, rf, df, FL: gl.constexpr, HD: gl.constexpr, NHB: gl.constexpr, KW: gl.constexpr,
               ZERO: gl.constexpr):
    """A kv_split slot ([NHB, KVT, KW]: the chunk's keys or its values, column block by block) made
    what the chunk holds: this launch's rows from L2 (`stale`, patch_block), then where `fix`, the
    new token's row (`new`) from nrow ([1, HD] fp32) and, with ZERO, zeros for rows past hi."""
    for c in gl.static_range(NHB):
        if stale:
            patch_block(slot.index(c), cache + c * KW, t0, ca, cb, row_a, in_a, row_b, in_b, ints, step, bs, f0, f1,
                        fresh, row_words, g, rf, df, FL, HD)
        if fix:
            x = slot.index(c).load(FL)
            if ZERO:
                x = gl.where((t0 + rf < hi)[:, None], x, 0.0)
            nx = nrow.slice(c * KW, KW, dim=1).load(FL)
            slot.index(c).store(gl.where(new, nx.to(gl.bfloat16), x))


@gluon.jit
def rope(x, xp, w, wp, cs, sn, eps, NORM, HD: gl.constexpr, d):
    """Heads x ([R, HD]; xp: the same rows with the halves swapped) RMS-normed by w (when NORM; wp
    its halves swapped) and rotated by the RoPE rows cs, sn ([HD], the half-rows repeated): the
    halves convention, x * cos + rot(x) * sin with rot(x) = (-x2, x1)."""
    sign = gl.where(d < HD // 2, -1.0, 1.0)
    if NORM:
        r = gl.rsqrt(gl.sum(x * x, axis=1) / HD + eps)[:, None]
        x = x * r * w[None, :]
        xp = xp * r * wp[None, :]
    return x * cs[None, :] + sign[None, :] * xp * sn[None, :]
