"""Gumbel noise for sampling on the device, and its numpy reference.

A row sampled at temperature T picks the token maximising logit / T + G, G = -log(-log(U)): the
Gumbel-max trick, which draws token i with probability softmax(logit / T)_i. U is Philox-4x32 (10
rounds) keyed by the row's 64-bit seed over the counter (token id, the step's context length, 0, 0),
made a float in [0, 1) as Triton's uint_to_uniform_float makes it: the numbers Triton's tl.philox
gives, which the megakernel's sampler draws too (llm/mk/sample.py), so a seeded request repeats on
either, and a token's noise depends on nothing but its seed, position and id. The Gluon body that
draws them in the kernel is sampling.py; this module holds the constants and the reference.
"""
from __future__ import annotations

import numpy as np

KEY_A, KEY_B = 0x9E3779B9, 0xBB67AE85            # the key's increments a round
ROUND_A, ROUND_B = 0xD2511F53, 0xCD9E8D57        # the round's multipliers
ROUNDS = 10
UNIFORM_SCALE = 4.6566127342e-10                 # the largest such that (2^31 - 1) * scale < 1 in float32
MASK = 0xFFFFFFFF


def philox(seed: int, c0, c1) -> np.ndarray:
    """The first output word of Philox-4x32-10 keyed by `seed` (64 bits) for counters (c0, c1, 0, 0)
    (arrays of uint32 values), as uint32."""
    seed &= (1 << 64) - 1
    k0, k1 = np.uint64(seed & MASK), np.uint64(seed >> 32)
    c0 = np.asarray(c0, dtype=np.uint64) & MASK
    c1 = np.broadcast_to(np.asarray(c1, dtype=np.uint64) & MASK, c0.shape).copy()
    c2, c3 = np.zeros_like(c0), np.zeros_like(c0)
    a, b, m = np.uint64(ROUND_A), np.uint64(ROUND_B), np.uint64(MASK)
    for _ in range(ROUNDS):
        _c0, _c2 = c0, c2
        c0 = ((b * _c2) >> np.uint64(32)) ^ c1 ^ k0
        c2 = ((a * _c0) >> np.uint64(32)) ^ c3 ^ k1
        c1 = (b * _c2) & m
        c3 = (a * _c0) & m
        k0 = (k0 + np.uint64(KEY_A)) & m
        k1 = (k1 + np.uint64(KEY_B)) & m
    return c0.astype(np.uint32)


def uniform(x: np.ndarray) -> np.ndarray:
    """uint32 -> float32 in [0, 1), as Triton's uint_to_uniform_float."""
    i = x.astype(np.uint32).view(np.int32).astype(np.int64)
    i = np.where(i < 0, ~i, i)
    return i.astype(np.float32) * np.float32(UNIFORM_SCALE)


def gumbel(seed: int, counter: int, idx) -> np.ndarray:
    """G for token ids `idx` at a step of context length `counter`, float32 (-inf where U is 0)."""
    u = uniform(philox(seed, np.asarray(idx, dtype=np.int64) & MASK, counter & MASK))
    with np.errstate(divide="ignore"):
        return (-np.log(-np.log(u))).astype(np.float32)
