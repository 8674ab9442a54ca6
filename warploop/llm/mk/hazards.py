"""Memory hazards of a decode graph: what each node reads and writes, and whether every
conflicting pair of nodes is ordered.

The CPU executor runs a graph's nodes one at a time in one fixed legal order, so a missing
dependency edge never shows there; on a GPU the two nodes run at once on different workers and
race. `hazards(dg)` finds such pairs without running anything.

Footprints (the columns of each buffer a node reads and writes, of every batch row or of one) are
declared per node kind in kinds.py, as functions of the node's fields by name.
tests/test_mk_hazards.py checks these declarations against the loads and stores the interpreter
really makes.
"""
from __future__ import annotations

import bisect
import dataclasses

import numpy as np

from warploop.llm.mk.kinds import KINDS, Access
from warploop.llm.mk.layout import Plan
from warploop.runtime.ancestry import ancestors


@dataclasses.dataclass(frozen=True)
class Hazard:
    kind: str            # RAW, WAR or WAW
    first: int           # node indices, first < second in recording (program) order
    second: int
    buffer: int
    columns: tuple[int, int]

    def describe(self, labels: list[str]) -> str:
        return (f"{self.kind} on buffer {self.buffer:#x} columns {self.columns[0]}:{self.columns[1]}: node "
                f"{self.first} ({labels[self.first]}) and node {self.second} ({labels[self.second]}) are not ordered")


class _Interval:
    """What is known of one elementary column interval of a buffer: its last writer of every row
    and the readers of every row since, then per row the last writer and readers since (a write of
    every row clears the rows)."""

    __slots__ = ("writer", "readers", "row_writer", "row_readers")

    def __init__(self):
        self.writer: int | None = None
        self.readers: list[int] = []
        self.row_writer: dict[int, int] = {}
        self.row_readers: dict[int, list[int]] = {}

    def writers_met(self, row: int):
        """The last writers an access of `row` (-1: every row) must come after."""
        if row >= 0:
            w = self.row_writer.get(row, self.writer)
            return () if w is None else (w,)
        if not self.row_writer:
            return () if self.writer is None else (self.writer,)
        return ([] if self.writer is None else [self.writer]) + list(self.row_writer.values())

    def readers_met(self, row: int):
        """The readers since those writers that a write of `row` must come after."""
        if not self.row_readers:
            return self.readers
        if row >= 0:
            return self.readers + self.row_readers.get(row, [])
        return self.readers + [r for rs in self.row_readers.values() for r in rs]

    def record(self, node: int, row: int, write: bool) -> None:
        if write and row < 0:
            self.writer, self.readers, self.row_writer, self.row_readers = node, [], {}, {}
        elif write:
            self.row_writer[row], self.row_readers[row] = node, []
        elif row < 0:
            self.readers.append(node)
        else:
            self.row_readers.setdefault(row, []).append(node)


class _Meeting:
    """One node's tests of the earlier nodes it meets: whether it comes after each (a node meets
    the same others over many intervals: each is tested once), and the hazards of those it does not."""

    __slots__ = ("node", "mine", "worker_of", "workers", "above", "after", "found")

    def __init__(self, node: int, worker_of: list[int], workers: np.ndarray, above: np.ndarray, found: dict):
        self.node, self.mine, self.worker_of, self.workers = node, worker_of[node], worker_of, workers
        self.above, self.after, self.found = above, {node: True}, found     # above: the ancestors' bits, bytes

    def ordered(self, o: int) -> bool:
        ok = self.after.get(o)
        if ok is None:
            ok = self.after[o] = self.worker_of[o] == self.mine or bool(self.above[o >> 3] >> (o & 7) & 1)
        return ok

    def all_ordered(self, others: set[int]) -> bool:
        if len(others) < 8:
            return all(self.ordered(o) for o in others)
        o = np.fromiter(others, np.int64, len(others))
        return bool(((self.workers[o] == self.mine) | (self.above[o >> 3] >> (o & 7) & 1 == 1)).all())

    def meet(self, others, kind: str, buffer: int, columns: tuple[int, int]) -> None:
        for o in others:
            if not self.ordered(o):
                self.found.setdefault((o, self.node, kind), Hazard(kind, o, self.node, buffer, columns))


def check(deps: list[tuple[int, ...]], worker_of: list[int], accesses: list[list[Access]]) -> list[Hazard]:
    """Every pair of nodes that touch the same columns of a buffer in a common row, one of them
    writing, must be ordered: by dependency edges (transitively) when on different workers; on
    one worker, by its list (recording) order, which holds by construction. Returns the pairs
    that are not.

    Per buffer the columns are cut into elementary intervals, each keeping its last writers and
    the readers since (_Interval): checking a new access against those suffices, as every earlier
    access was checked against them in turn and the order is transitive. (Checking a pair more
    than needed reports nothing false: any two conflicting accesses must be ordered.)

    A buffer no access of one row touches (most: all but the attention's) keeps its intervals'
    last writers and readers in two flat lists instead, so that an access over many intervals (a
    GEMV tile reading all of its input) meets their distinct nodes once, as slices and sets. Either
    way the nodes an access meets are tested together, and the intervals are walked one by one, in
    the same order, only to name the pairs of an access that meets an unordered node.
    """
    cls, by_class = ancestors(deps)
    anc = [by_class[c] for c in cls]         # a stage's tiles share one set (one int object)
    cuts: dict[int, list[int]] = {}
    rowful: set[int] = set()
    for accs in accesses:
        for a in accs:
            cuts.setdefault(a.buffer, set()).update((a.lo, a.hi))
            if a.row >= 0:
                rowful.add(a.buffer)
    cuts = {b: sorted(c) for b, c in cuts.items()}
    state = {b: [_Interval() for _ in range(len(c) - 1)] for b, c in cuts.items() if b in rowful}
    writer = {b: [None] * (len(c) - 1) for b, c in cuts.items() if b not in rowful}
    readers = {b: [[] for _ in range(len(c) - 1)] for b, c in cuts.items() if b not in rowful}
    nbytes = (len(deps) + 7) // 8
    bits_of: dict[int, np.ndarray] = {}     # id of an ancestor set -> its bytes, to test many bits at once
    workers = np.asarray(worker_of)
    found: dict[tuple[int, int, str], Hazard] = {}

    for node, accs in enumerate(accesses):
        above = anc[node]
        above_bytes = bits_of.get(id(above))
        if above_bytes is None:
            above_bytes = bits_of[id(above)] = np.frombuffer(above.to_bytes(nbytes, "little"), np.uint8)
        meeting = _Meeting(node, worker_of, workers, above_bytes, found)
        meet = meeting.meet
        updates, flat = [], []
        for a in accs:
            cut, row = cuts[a.buffer], a.row
            lo, hi = bisect.bisect_left(cut, a.lo), bisect.bisect_left(cut, a.hi)
            first = "WAW" if a.write else "RAW"
            if a.buffer in writer:
                ws, rs = writer[a.buffer], readers[a.buffer]
                met = set(ws[lo:hi])
                met.discard(None)
                if a.write:
                    met.update(*rs[lo:hi])
                if not meeting.all_ordered(met):
                    for k in range(lo, hi):
                        columns = (cut[k], cut[k + 1])
                        if ws[k] is not None:
                            meet((ws[k],), first, a.buffer, columns)
                        if a.write:
                            meet(rs[k], "WAR", a.buffer, columns)
                flat.append((ws, rs, lo, hi, a.write))
                continue
            ivs = state[a.buffer]
            met = set()
            for k in range(lo, hi):
                iv = ivs[k]
                met.update(iv.writers_met(row))
                if a.write:
                    met.update(iv.readers_met(row))
                updates.append((iv, row, a.write))
            if not meeting.all_ordered(met):      # as for the flat buffers: name the pairs only then
                for k in range(lo, hi):
                    iv = ivs[k]
                    columns = (cut[k], cut[k + 1])
                    meet(iv.writers_met(row), first, a.buffer, columns)
                    if a.write:
                        meet(iv.readers_met(row), "WAR", a.buffer, columns)
        for ws, rs, lo, hi, write in flat:
            if write:
                ws[lo:hi] = [node] * (hi - lo)
                rs[lo:hi] = [[] for _ in range(lo, hi)]
        for _, rs, lo, hi, write in flat:
            if not write:
                for r in rs[lo:hi]:
                    r.append(node)
        for iv, row, write in updates:
            if write:
                iv.record(node, row, True)
        for iv, row, write in updates:
            if not write:
                iv.record(node, row, False)
    return sorted(found.values(), key=lambda h: (h.second, h.first))


def graph_accesses(dg, plan: Plan) -> list[list[Access]]:
    """Each node's footprint, from its kind's declaration over its fields by name."""
    return [KINDS[kind].footprint(KINDS[kind].named(node.args), plan)
            for kind, node in zip(dg.labels, dg.graph.nodes, strict=True)]


def hazards(dg, plan: Plan) -> list[Hazard]:
    """The unordered conflicting node pairs of decode graph `dg` (graph.DecodeGraph) as placed."""
    if dg.graph.schedule is None:
        dg.graph.descriptors()          # placement and counters only: nothing is uploaded
    deps = [tuple(n.deps) for n in dg.graph.nodes]
    return check(deps, list(dg.graph.schedule.worker_of), graph_accesses(dg, plan))


def unrealised_edges(deps: list[tuple[int, ...]], schedule) -> list[tuple[int, int]]:
    """Dependency edges (d, i) the compiled schedule does not enforce: d neither precedes i on
    i's worker nor signals a counter that i (or a join point just before it) waits on to the
    count of that counter's signallers."""
    position, waits_of, signal = {}, {}, {}
    for lst in schedule.lists:
        pending: list = []
        for k, inst in enumerate(lst):
            pending += inst.waits
            if inst.node >= 0:
                position[inst.node], waits_of[inst.node], signal[inst.node] = k, set(pending), inst.signal
                pending = []
    signallers: dict[int, int] = {}
    for s in signal.values():
        if s >= 0:
            signallers[s] = signallers.get(s, 0) + 1
    worker_of = schedule.worker_of
    # the counter waits that would realise the edges of each deps tuple (None: a node that signals
    # none); where all lie among i's waits every edge is realised, whatever the workers (a stage's
    # tiles share one tuple of many nodes that signal one counter)
    needs: dict[tuple[int, ...], set] = {}
    missing = []
    for i, ds in enumerate(deps):
        need = needs.get(ds)
        if need is None:
            need = needs[ds] = {(signal[d], signallers[signal[d]]) if signal[d] >= 0 else None for d in ds}
        if None not in need and need <= waits_of[i]:
            continue
        for d in ds:
            local = worker_of[d] == worker_of[i] and position[d] < position[i]
            counted = signal[d] >= 0 and (signal[d], signallers[signal[d]]) in waits_of[i]
            if not (local or counted):
                missing.append((d, i))
    return missing
