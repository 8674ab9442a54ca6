"""The ends of the decode graph: token ids in (embedding gather), token ids out (greedy argmax).

The engine's sampler (temperature, top-k/p, min-p, penalties, seeds) still runs on the logits on
the host path; argmax_node is the graph's own greedy pick, the first piece of sampling on the GPU.
"""
from __future__ import annotations

import triton
import triton.language as tl

from warploop.llm.mk.layout import step_field, step_rows
from warploop.runtime.sync import i64


@triton.jit
def embed_node(inp, table, res, d, BK: tl.constexpr):
    """res[b, :] = table[token_ids[b], :]: the residual stream starts as the embedding."""
    cols = tl.arange(0, BK)
    for b in range(step_rows(inp)):
        src = table + step_field(inp, 0, b).to(tl.int64) * d
        for c0 in range(0, d, BK):
            c = c0 + cols
            tl.store(res + i64(b) * d + c, tl.load(src + c, mask=c < d), mask=c < d)


@triton.jit
def argmax_node(inp, logits, tokens, vocab, BK: tl.constexpr):
    """tokens[b] = the first index of the largest logit of row b (torch.argmax's tie rule)."""
    cols = tl.arange(0, BK)
    for b in range(step_rows(inp)):
        row = logits + i64(b) * vocab
        best = tl.full([], float("-inf"), tl.float32)
        index = tl.full([], 0, tl.int32)
        for v0 in range(0, vocab, BK):
            c = v0 + cols
            x = tl.load(row + c, mask=c < vocab, other=float("-inf"))
            top = tl.max(x, axis=0)
            at = tl.min(tl.where(x == top, c, vocab), axis=0)
            index = tl.where(top > best, at, index)
            best = tl.maximum(best, top)
        tl.store(tokens + b, index)
