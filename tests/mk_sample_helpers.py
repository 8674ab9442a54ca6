"""Shared by tests/test_mk_sample.py: the graph's sampling nodes alone (sample tiles over spans of the
vocabulary, then the combine) over a given logits block, on a runtime's CPU executor."""
from __future__ import annotations

import torch

from warploop.llm.mk.graph import spans
from warploop.llm.mk.kinds import KINDS
from warploop.llm.mk.layout import Plan, RowSampling, StepInputs

PLAN = Plan("fp32", 4, 2, 16, 4, bn=16, candidates=16)   # 16-token spans: several tiles for a small vocab


class SampleGraph:
    """Sample tiles and a combine recorded once for `batch` rows of `vocab` logits; `draw` replays it."""

    def __init__(self, rt, tasks, batch: int, vocab: int, history_width: int = 8, nodes: int = 4) -> None:
        self.rt, self.tasks = rt, tasks
        self.batch, self.vocab, self.history_width = batch, vocab, history_width
        self.logits = torch.zeros(batch, vocab, dtype=torch.float32)
        vs = spans(vocab, PLAN.bn, nodes)
        self.tiles = len(vs)
        self.fstat = torch.zeros(batch, len(vs), 3)
        self.istat = torch.zeros(batch, len(vs), 2 + PLAN.candidates, dtype=torch.int32)
        self.tokens = torch.zeros(batch, dtype=torch.int32)
        self.inp = torch.zeros(StepInputs.words(batch, 1, history_width), dtype=torch.int32)
        self.graph = rt.graph()
        inp = self.graph.param("inp", "*i32")
        stats = dict(inp=inp, logits=self.logits, fstat=self.fstat, istat=self.istat, vocab=vocab, ntiles=len(vs))
        tile, combine = KINDS["sample_tile"], KINDS["sample_combine"]
        tiles = [self.graph.add(tasks.sample_tile, *tile.args(dict(stats, row0=s[0], count=s[1], tile=t)))
                 for t, s in enumerate(vs)]
        self.graph.add(tasks.sample_combine, *combine.args(dict(stats, tokens=self.tokens)), after=tiles)

    def draw(self, logits: torch.Tensor, sampling: list[RowSampling], history=()) -> list[int]:
        """One token id per row of `logits` (-1: the row's filters reach past the candidates)."""
        n = logits.shape[0]
        self.logits[:n] = logits
        step = StepInputs(self.batch, 1, (0,) * n, (0,) * n, (1,) * n, (0,) * n, ((0,),) * n, tuple(sampling),
                          tuple(history), self.history_width)
        self.inp.numpy()[:] = step.serialize()
        self.graph.run(inp=self.inp, timeout=60)
        return self.tokens[:n].tolist()
