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

from warploop.llm.mk.kinds import KINDS, Access
from warploop.llm.mk.layout import Plan


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


def ancestors(deps: list[tuple[int, ...]]) -> list[int]:
    """Bit sets: bit a of result[b] is set when node a reaches node b through dependency edges."""
    out: list[int] = []
    for ds in deps:
        bits = 0
        for d in ds:
            bits |= out[d] | (1 << d)
        out.append(bits)
    return out


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


def check(deps: list[tuple[int, ...]], worker_of: list[int], accesses: list[list[Access]]) -> list[Hazard]:
    """Every pair of nodes that touch the same columns of a buffer in a common row, one of them
    writing, must be ordered: by dependency edges (transitively) when on different workers; on
    one worker, by its list (recording) order, which holds by construction. Returns the pairs
    that are not.

    Per buffer the columns are cut into elementary intervals, each keeping its last writers and
    the readers since (_Interval): checking a new access against those suffices, as every earlier
    access was checked against them in turn and the order is transitive. (Checking a pair more
    than needed reports nothing false: any two conflicting accesses must be ordered.)
    """
    anc = ancestors(deps)
    cuts: dict[int, list[int]] = {}
    for accs in accesses:
        for a in accs:
            cuts.setdefault(a.buffer, set()).update((a.lo, a.hi))
    cuts = {b: sorted(c) for b, c in cuts.items()}
    state = {b: [_Interval() for _ in range(len(c) - 1)] for b, c in cuts.items()}
    found: dict[tuple[int, int, str], Hazard] = {}

    for node, accs in enumerate(accesses):
        # whether node comes after each earlier node it meets: a node meets the same others over
        # many intervals, and a test of its ancestors' bit shifts an integer of one bit a node
        after = {node: True}
        mine, above = worker_of[node], anc[node]
        updates = []
        for a in accs:
            cut, ivs, row = cuts[a.buffer], state[a.buffer], a.row
            lo, hi = bisect.bisect_left(cut, a.lo), bisect.bisect_left(cut, a.hi)
            first = "WAW" if a.write else "RAW"
            for k in range(lo, hi):
                iv = ivs[k]
                met = ((iv.writers_met(row), first), (iv.readers_met(row), "WAR")) if a.write else \
                    ((iv.writers_met(row), first),)
                for others, kind in met:
                    for o in others:
                        ok = after.get(o)
                        if ok is None:
                            ok = after[o] = worker_of[o] == mine or bool((above >> o) & 1)
                        if not ok:
                            found.setdefault((o, node, kind), Hazard(kind, o, node, a.buffer, (cut[k], cut[k + 1])))
                updates.append((iv, row, a.write))
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
    missing = []
    for i, ds in enumerate(deps):
        for d in ds:
            local = worker_of[d] == worker_of[i] and position[d] < position[i]
            counted = signal[d] >= 0 and (signal[d], signallers[signal[d]]) in waits_of[i]
            if not (local or counted):
                missing.append((d, i))
    return missing
