"""Shared by tests/test_mk_loop.py and tests/test_mk_gpu.py: the same decode steps as single graph
steps and as one loop request, over host-kept block tables."""
from __future__ import annotations

import numpy as np

from warploop.llm.backend import ModelBatch
from warploop.llm.kv_cache import cdiv

BS = 4


class Rows:
    """Sequences as the host keeps them: tokens, block tables, and a pool of blocks to take from."""

    def __init__(self, prompts, pool):
        self.tokens = [list(p) for p in prompts]
        self.tables = [[] for _ in prompts]
        self.pool = list(pool)
        for i, p in enumerate(prompts):
            self.grow(i, len(p))

    def grow(self, i, tokens):
        while len(self.tables[i]) < cdiv(tokens, BS):
            self.tables[i].append(self.pool.pop(0))

    def decode_batch(self):
        """The next decode step: each row's newest token (its KV not yet written)."""
        n = [len(t) for t in self.tokens]
        return ModelBatch([t[-1] for t in self.tokens], [k - 1 for k in n], [1] * len(n), n,
                          [list(t) for t in self.tables])


def prefill(mk, prompts, pool):
    rows = Rows(prompts, pool)
    lens = [len(p) for p in prompts]
    batch = ModelBatch([t for p in prompts for t in p], [i for p in prompts for i in range(len(p))], lens[:],
                       lens[:], rows.tables)
    first = mk.forward(batch).argmax(-1).tolist()
    for i, t in enumerate(first):
        rows.tokens[i].append(t)
        rows.grow(i, len(rows.tokens[i]))
    return rows


def single_steps(mk, prompts, pool, steps):
    """Greedy single decode steps on the graph: each row's tokens, and the blocks each row took."""
    rows = prefill(mk, prompts, pool)
    start = [len(t) for t in rows.tables]
    for _ in range(steps):
        got = mk.forward(rows.decode_batch()).argmax(-1).tolist()
        for i, t in enumerate(got):
            rows.tokens[i].append(t)
            rows.grow(i, len(rows.tokens[i]))
    return rows.tokens, [t[s:] for t, s in zip(rows.tables, start, strict=True)]


def loop(mk, prompts, pool, steps, remaining=None, stops=None, free=None, before=None):
    """One loop request after the same prefill: (tokens, blocks) ring rows, its status, the rows."""
    rows = prefill(mk, prompts, pool)
    n = len(prompts)
    free = rows.pool[:2 * n * (cdiv(steps, BS) + 1)] if free is None else free
    run = mk.start_loop(rows.decode_batch(), [GreedySeq() for _ in prompts], steps,
                        remaining or [steps + 1] * n, stops or [[] for _ in prompts], free)
    if before:
        before(run)
    tokens, blocks = run.take(wait_s=60)
    while not run.finished():
        more = run.take(wait_s=60)
        tokens, blocks = np.concatenate([tokens, more[0]]), np.concatenate([blocks, more[1]])
    return tokens, blocks, run.status, rows, free


class GreedySeq:
    """A sequence as start_loop reads it: greedy, a fixed seed."""

    class params:
        temperature, top_k, top_p, min_p, repetition_penalty, seed = 0.0, 0, 1.0, 0.0, 1.0, 7
