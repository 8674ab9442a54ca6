"""The start of the decode graph: token ids in (the embedding gather). Token ids out: sample.py."""
from __future__ import annotations

import triton
import triton.language as tl

from warploop.llm.mk.layout import step_field, step_rows
from warploop.runtime.sync import i64


@triton.jit
def embed_node(inp, table, res, work, d, BK: tl.constexpr, PN: tl.constexpr, PR: tl.constexpr):
    """res[b, :] = table[token_ids[b], :]: the residual stream starts as the embedding. With split
    tiles (PN rows, PR row blocks of the hidden size) it also leaves each row block's sum of squares
    in `work` for the first RMSNorm (gemv_split.py), reading a whole row as one [PR, PN] block.
    PN -1: a batch-1 kernel (Plan.one_row), as PN 0."""
    if PN > 0:
        j = tl.arange(0, triton.next_power_of_2(PR))
        c = j[:, None] * PN + tl.arange(0, PN)[None, :]
        for b in range(step_rows(inp)):
            src = table + step_field(inp, 0, b).to(tl.int64) * d
            v = tl.load(src + c, mask=c < d, other=0.0)
            tl.store(res + i64(b) * d + c, v, mask=c < d)
            v = v.to(tl.float32)
            tl.store(work + b * PR + j, tl.sum(v * v, axis=1), mask=j < PR)
    else:
        cols = tl.arange(0, BK)
        for b in range(step_rows(inp)):
            src = table + step_field(inp, 0, b).to(tl.int64) * d
            for c0 in range(0, d, BK):
                c = c0 + cols
                tl.store(res + i64(b) * d + c, tl.load(src + c, mask=c < d), mask=c < d)
