"""The ancestors of every node of a dependency graph, as bit sets, for the hazard checks
(runtime/stream/hazards.py, llm/mk/hazards.py): node a is an ancestor of node b when a path of
dependency edges leads from a to b.

    cls, anc = ancestors([n.deps for n in nodes])
    anc[cls[b]] >> a & 1                          # whether node a is an ancestor of node b
"""
from __future__ import annotations

from collections.abc import Sequence


def ancestors(deps: Sequence[tuple[int, ...]]) -> tuple[list[int], list[int]]:
    """Each node's class (the number of its deps tuple, in order of first use) and each class's
    ancestors as a bitset (bit j: node j), for nodes in recording order given by their deps (each
    node's dependencies, recorded earlier; the caller holds the tuples, as one is known again by its
    id). Nodes with one deps tuple (a stage's tiles) have one set of ancestors: each is worked out
    once per tuple, from each class among its dependencies once and each run of consecutive ones (a
    stage's tiles) as one mask."""
    cls: list[int] = []
    anc: list[int] = []
    number: dict[tuple[int, ...], int] = {}
    same: dict[int, int] = {}                    # id(deps) -> class: a stage's tiles share one tuple, hashed once
    for ds in deps:
        c = same.get(id(ds))
        if c is None:
            c = same[id(ds)] = number.get(ds, len(anc))
        if c == len(anc):
            number[ds] = c
            a = 0
            for k in {cls[d] for d in ds}:
                a |= anc[k]
            run = sorted(set(ds))
            i = 0
            while i < len(run):
                j = i
                while j + 1 < len(run) and run[j + 1] == run[j] + 1:
                    j += 1
                a |= ((1 << (j - i + 1)) - 1) << run[i]
                i = j + 1
            anc.append(a)
        cls.append(c)
    return cls, anc
