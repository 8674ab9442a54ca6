"""The streaming kernel's Gumbel noise (philox.py has the algorithm and its numpy reference): a
lm_head tile of a row sampled at temperature T leaves max(logit / T + G) and its offset as its amax
pair, so SAMPLE's argmax over the tiles draws the row's token from softmax(logit / T)."""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from warploop.runtime.stream import philox

KEY_A, KEY_B = gl.constexpr(philox.KEY_A), gl.constexpr(philox.KEY_B)
ROUND_A, ROUND_B = gl.constexpr(philox.ROUND_A), gl.constexpr(philox.ROUND_B)
ROUNDS = gl.constexpr(philox.ROUNDS)
UNIFORM_SCALE = gl.constexpr(philox.UNIFORM_SCALE)
MASK = gl.constexpr(philox.MASK)


@gluon.jit
def gumbel(seed_lo, seed_hi, counter, idx):
    """G for token ids `idx` (an int tensor) at a step of context length `counter`, the row's seed
    given as its two 32-bit halves (int32 words): philox.gumbel's numbers. The 32-bit words are
    held in int64 and masked after each product, which wraps as uint32 arithmetic does."""
    c0 = idx.to(gl.int64) & MASK
    c1 = c0 * 0 + (counter.to(gl.int64) & MASK)
    c2 = c0 * 0
    c3 = c0 * 0
    k0 = seed_lo.to(gl.int64) & MASK
    k1 = seed_hi.to(gl.int64) & MASK
    for _ in gl.static_range(ROUNDS):
        p0 = c2.to(gl.uint64) * ROUND_B             # < 2^64: exact in uint64
        p1 = c0.to(gl.uint64) * ROUND_A
        c0 = ((p0 >> 32).to(gl.int64) ^ c1 ^ k0) & MASK
        c2 = ((p1 >> 32).to(gl.int64) ^ c3 ^ k1) & MASK
        c1 = (p0 & MASK).to(gl.int64)
        c3 = (p1 & MASK).to(gl.int64)
        k0 = (k0 + KEY_A) & MASK
        k1 = (k1 + KEY_B) & MASK
    bits = gl.where(c0 >= 2 ** 31, c0 - 2 ** 32, c0)     # as int32
    bits = gl.where(bits < 0, -bits - 1, bits)
    u = bits.to(gl.float32) * UNIFORM_SCALE
    return -gl.log(-gl.log(u))
