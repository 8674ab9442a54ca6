"""The start of the decode graph: token ids in (the embedding gather). Token ids out: sample.py."""
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
