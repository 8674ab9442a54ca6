"""Sampling on the GPU: the decode graph's last nodes turn each live row's logits into a token id.

Split the way lm_head is: one sample tile per lm_head span, then one combine node per step.

sample_tile_node     for its vocab span and every live row: the repetition penalty in place (the
                     row's distinct previous tokens that fall in the span), then in one pass the
                     span's largest logit and its first index (greedy), the winner of an
                     exponential race over the whole span (Gumbel-max: x / T + G with
                     G = -log(-log(U)), which picks token i with probability softmax(x / T)_i),
                     and for filtered rows its sum of exp(x / T) relative to its max (the
                     softmax's denominator, merged by log-sum-exp) and its KC largest logits;
                     greedy rows read only the largest logit, WIDE_LANES * KC logits a step
sample_combine_node  per row: greedy rows take the first index of the largest logit; rows with no
                     filter take the race winner among tiles; filtered rows (top-k, top-p, min-p)
                     merge the tiles' candidates into the row's KC largest, apply the filters to
                     their exact probabilities and race among the kept ones

The noise of token i is philox(seed, i, counter): a function of the row's seed, the token and the
step, so a tile and the combine draw the same G for a token, a fixed seed repeats, and rows do not
depend on each other. The filters keep a set of top tokens; when that set may reach past the KC
candidates (top_k 0 or > KC, and neither top_p's nor min_p's cut falls inside them) the combine
cannot draw exactly and writes -1: the backend samples that row on the host path instead.
Order and rules as in warploop/llm/sampler.py (transformers'): penalty, temperature, top-k, top-p
(drop a token once the tokens ranked above it hold top_p), min-p (relative to the top token).
"""
from __future__ import annotations

import triton
import triton.language as tl

from warploop.llm.mk.layout import step_field, step_float, step_history, step_rows
from warploop.runtime.sync import i64

F_STATS: tl.constexpr = tl.constexpr(3)   # per tile and row, float32: max, sum of exp, race value
I_HEAD: tl.constexpr = tl.constexpr(2)    # per tile and row, int32: argmax, race index, then KC candidates
NO_KEY: tl.constexpr = tl.constexpr(-(2 ** 63))
# greedy rows and the combine's pass over the tiles read WIDE_LANES * KC values a load: a row's
# reductions are a chain of barriers, so fewer, wider steps (batch 8 spent 176 us a step sampling)
WIDE_LANES: tl.constexpr = tl.constexpr(16)


@triton.jit
def row_seed(inp, b):
    lo = step_field(inp, 9, b).to(tl.int64) & 0xFFFFFFFF
    return (step_field(inp, 10, b).to(tl.int64) << 32) | lo


@triton.jit
def gumbel(seed, counter, idx):
    """G ~ Gumbel(0, 1) for token ids idx (int32), from philox keyed by (seed; idx, counter)."""
    r, _, _, _ = tl.philox(seed, idx, tl.zeros_like(idx) + counter, tl.zeros_like(idx), tl.zeros_like(idx))
    u = tl.uint_to_uniform_float(r)          # [0, 1): u = 0 gives -inf, never drawn
    return -tl.log(-tl.log(u))


@triton.jit
def order_key(x, idx):
    """int64 keys ordered as (x, then the lower index first): float bits made monotone, high word."""
    bits = x.to(tl.int32, bitcast=True)
    ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    return (ordered.to(tl.int64) << 32) | (0x7FFFFFFF - idx).to(tl.int64)


@triton.jit
def key_index(key):
    return tl.where(key == NO_KEY, -1, 0x7FFFFFFF - (key & 0xFFFFFFFF).to(tl.int32))


@triton.jit
def merge_top(best, keys, KC: tl.constexpr):
    """The KC largest of two KC-key blocks, largest first. By rank (how many keys beat each one, equal
    keys ordered by place) rather than a sort: two [2KC, 2KC] comparisons and one [2KC, KC] select,
    where tl.topk's bitonic network costs the Triton interpreter twenty times as much."""
    both = tl.reshape(tl.join(best, keys), [2 * KC])
    i = tl.arange(0, 2 * KC)
    beats = (both[None, :] > both[:, None]) | ((both[None, :] == both[:, None]) & (i[None, :] < i[:, None]))
    rank = tl.sum(beats.to(tl.int32), axis=1)
    return tl.sum(tl.where(rank[:, None] == tl.arange(0, KC)[None, :], both[:, None], 0), axis=0)


@triton.jit
def first_max(x, idx, none, best, arg):
    """(best, arg, top): the running largest value and its first index after block x at indices idx
    (in order; `none` past them), and the block's own largest. A later block replaces the pair only
    with a strictly larger value, so ties keep the lowest index (torch.argmax's rule)."""
    top = tl.max(x, axis=0)
    at = tl.min(tl.where(x == top, idx, none), axis=0)
    return tl.maximum(best, top), tl.where(top > best, at, arg), top


@triton.jit
def sample_tile_node(inp, logits, fstat, istat, vocab, row0, count, tile, ntiles, KC: tl.constexpr):
    WIDE: tl.constexpr = WIDE_LANES * KC
    end = tl.minimum(row0 + count, vocab)
    lanes = tl.arange(0, KC)
    wide = tl.arange(0, WIDE)
    for b in range(step_rows(inp)):
        row = logits + i64(b) * vocab
        temp = step_float(inp, 4, b)
        tn = tl.where(temp > 0, temp, 1.0)
        pen = step_float(inp, 8, b)
        listed = step_field(inp, 12, b)
        if pen != 1.0:
            hist = step_history(inp, b)
            for h0 in range(0, listed, KC):
                h = tl.load(hist + h0 + lanes, mask=h0 + lanes < listed, other=-1)
                mine = (h >= row0) & (h < end)
                x = tl.load(row + h, mask=mine, other=0.0)
                tl.store(row + h, tl.where(x > 0, x / pen, x * pen), mask=mine)
            tl.debug_barrier()      # the penalised logits are read back below by other threads
        seed = row_seed(inp, b)
        counter = step_field(inp, 11, b)
        sampled = temp > 0
        filtered = sampled & ~(((step_field(inp, 5, b) <= 0) | (step_field(inp, 5, b) >= vocab))
                               & (step_float(inp, 6, b) >= 1.0) & (step_float(inp, 7, b) <= 0.0))
        best = tl.full([], float("-inf"), tl.float32)
        arg = tl.full([], 0, tl.int32)
        m = tl.full([], float("-inf"), tl.float32)
        s = tl.full([], 0.0, tl.float32)
        race = tl.full([], float("-inf"), tl.float32)
        winner = tl.full([], 0, tl.int32)
        cand = tl.full([KC], NO_KEY, tl.int64)
        if sampled:           # KC logits a step: the noise, and the candidates of filtered rows
            for c0 in range(row0, end, KC):
                c = c0 + lanes
                valid = c < end
                x = tl.load(row + c, mask=valid, other=float("-inf"))
                best, arg, top = first_max(x, c, vocab, best, arg)
                g = tl.where(valid, x / tn + gumbel(seed, counter, c), float("-inf"))
                race, winner, _ = first_max(g, c, vocab, race, winner)
                if filtered:      # only filtered rows need exact probabilities: the softmax's sum and candidates
                    m_new = tl.maximum(m, top)
                    s = s * tl.exp((m - m_new) / tn) + tl.sum(tl.where(valid, tl.exp((x - m_new) / tn), 0.0), axis=0)
                    m = m_new
                    cand = merge_top(cand, tl.where(valid, order_key(x, c), NO_KEY), KC)
        else:                 # greedy: the span's first largest logit, WIDE logits a load
            for c0 in range(row0, end, WIDE):
                c = c0 + wide
                x = tl.load(row + c, mask=c < end, other=float("-inf"))
                best, arg, _ = first_max(x, c, vocab, best, arg)
        f = fstat + (i64(b) * ntiles + tile) * F_STATS
        tl.store(f, best)
        tl.store(f + 1, s)
        tl.store(f + 2, race)
        ip = istat + (i64(b) * ntiles + tile) * (I_HEAD + KC)
        tl.store(ip, arg)
        tl.store(ip + 1, winner)
        tl.store(ip + I_HEAD + lanes, key_index(cand))


@triton.jit
def sample_combine_node(inp, logits, fstat, istat, tokens, vocab, ntiles, KC: tl.constexpr):
    """tokens[b]: the row's sampled id, or -1 where the filters reach past the candidates."""
    WIDE: tl.constexpr = WIDE_LANES * KC
    lanes = tl.arange(0, KC)
    wide = tl.arange(0, WIDE)
    for b in range(step_rows(inp)):
        row = logits + i64(b) * vocab
        temp = step_float(inp, 4, b)
        tn = tl.where(temp > 0, temp, 1.0)
        top_k = step_field(inp, 5, b)
        top_p = step_float(inp, 6, b)
        top_p = tl.where(top_p >= 1.0, 2.0, top_p)    # off: no float cumulative sum may reach it
        min_p = step_float(inp, 7, b)
        f = fstat + i64(b) * ntiles * F_STATS
        ip = istat + i64(b) * ntiles * (I_HEAD + KC)
        big = tl.full([], float("-inf"), tl.float32)
        first = tl.full([], 0, tl.int32)
        race = tl.full([], float("-inf"), tl.float32)
        won = tl.full([], 0, tl.int32)                    # the tile whose race value is the largest
        for t0 in range(0, ntiles, WIDE):     # tiles in order: the first tile holding the max has its first index
            t = t0 + wide
            tm = tl.load(f + t * F_STATS, mask=t < ntiles, other=float("-inf"))
            big, first, _ = first_max(tm, t, ntiles, big, first)
            rv = tl.load(f + t * F_STATS + 2, mask=t < ntiles, other=float("-inf"))
            race, won, _ = first_max(rv, t, ntiles, race, won)
        greedy = tl.load(ip + first * (I_HEAD + KC))
        winner = tl.load(ip + won * (I_HEAD + KC) + 1)
        z = tl.full([], 0.0, tl.float32)
        cand = tl.full([KC], NO_KEY, tl.int64)
        unfiltered = ((top_k <= 0) | (top_k >= vocab)) & (top_p > 1.0) & (min_p <= 0.0)
        if (temp > 0) & ~unfiltered:
            for t in range(ntiles):
                z += tl.load(f + t * F_STATS + 1) * tl.exp((tl.load(f + t * F_STATS) - big) / tn)
                idx = tl.load(ip + t * (I_HEAD + KC) + I_HEAD + lanes)
                x = tl.load(row + idx, mask=idx >= 0, other=float("-inf"))
                cand = merge_top(cand, tl.where(idx >= 0, order_key(x, idx), NO_KEY), KC)
        idx = key_index(cand)
        valid = idx >= 0
        x = tl.load(row + idx, mask=valid, other=float("-inf"))
        p = tl.where(valid, tl.exp((x - big) / tn) / tl.where(z > 0, z, 1.0), 0.0)   # z = 0: not drawn here
        p0 = tl.max(p, axis=0)
        above = tl.cumsum(p, axis=0) - p
        keep = valid & ((top_k <= 0) | (lanes < top_k)) & (above < top_p) & (p >= min_p * p0)
        g = tl.where(keep, x / tn + gumbel(row_seed(inp, b), step_field(inp, 11, b), tl.where(valid, idx, 0)),
                     float("-inf"))
        gtop = tl.max(g, axis=0)
        drawn = tl.min(tl.where(g == gtop, idx, vocab), axis=0)
        everything = tl.sum(valid.to(tl.int32), axis=0) < KC          # the vocab is smaller than KC
        inside = ((top_k > 0) & (top_k <= KC)) | (tl.sum(p, axis=0) >= top_p) | everything \
            | ((min_p > 0) & (tl.min(tl.where(valid, p, 2.0), axis=0) < min_p * p0))
        token = tl.where(unfiltered, winner, tl.where(inside, drawn, -1))
        tl.store(tokens + b, tl.where(temp > 0, token, greedy))
