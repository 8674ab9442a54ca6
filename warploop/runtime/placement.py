"""Static-graph compilation: place nodes on workers by cost, then derive dependency counters.

Placement is list scheduling in recording order (which is topological: a node can only depend on
nodes recorded before it). Each node goes to the worker where it would finish first, counting a
`hop` of latency for every predecessor that ran on another worker, so chains stay on one worker
and wide layers spread out. Because every worker's list is in recording order, every wait is on
a node earlier in one global order, which all co-resident workers reach: no deadlock.

Counters: nodes with the same set of successors share one counter (all tiles of a layer feed
all tiles of the next: one counter, counting to the tile count). A node waits on each counter
among its predecessors, except one whose signallers all precede it on its own worker. A node
with more than two waits gets NOP instructions in front of it on its worker, carrying the rest.
"""
from __future__ import annotations

import dataclasses

from warploop.runtime.descriptor import MAX_WAITS


@dataclasses.dataclass(frozen=True)
class NodeSpec:
    deps: tuple[int, ...] = ()
    cost: float = 1.0
    worker: int | None = None     # pin to a worker


@dataclasses.dataclass(frozen=True)
class Inst:
    node: int                     # -1: NOP join point
    waits: tuple[tuple[int, int], ...]
    signal: int


@dataclasses.dataclass(frozen=True)
class Schedule:
    worker_of: tuple[int, ...]
    lists: tuple[tuple[Inst, ...], ...]      # per worker, in execution order
    counter_sizes: tuple[int, ...]           # signals per run, per counter
    makespan: float                          # estimated, in cost units

    @property
    def instruction_count(self) -> int:
        return sum(len(lst) for lst in self.lists)


def place(nodes: list[NodeSpec], workers: int, hop: float = 0.5) -> Schedule:
    if workers < 1:
        raise ValueError("need at least one worker")
    for i, n in enumerate(nodes):
        if any(not 0 <= d < i for d in n.deps):
            raise ValueError(f"node {i} depends on {n.deps}: dependencies must be recorded earlier")
        if n.worker is not None and not 0 <= n.worker < workers:
            raise ValueError(f"node {i} is pinned to worker {n.worker}, but there are {workers} workers")
        if n.cost < 0:
            raise ValueError(f"node {i} has negative cost {n.cost}")
    free = [0.0] * workers
    finish = [0.0] * len(nodes)
    worker_of = [0] * len(nodes)
    order: list[list[int]] = [[] for _ in range(workers)]
    for i, n in enumerate(nodes):
        # Latest predecessor finish per worker, and the two largest over distinct workers, so that
        # "ready on w" costs O(1) per worker: its own predecessors, or the others' plus a hop.
        by_worker: dict[int, float] = {}
        for d in n.deps:
            by_worker[worker_of[d]] = max(by_worker.get(worker_of[d], 0.0), finish[d])
        ranked = sorted(by_worker.items(), key=lambda kv: -kv[1])[:2] + [(-1, 0.0), (-1, 0.0)]
        candidates = [n.worker] if n.worker is not None else range(workers)
        best = None
        for w in candidates:
            remote = ranked[1][1] if ranked[0][0] == w else ranked[0][1]
            ready = max(free[w], by_worker.get(w, 0.0), remote + hop if remote else 0.0)
            key = (ready + n.cost, len(order[w]), w)
            if best is None or key < best[0]:
                best = (key, w, ready)
        _, w, ready = best
        worker_of[i], finish[i], free[w] = w, ready + n.cost, ready + n.cost
        order[w].append(i)
    signal, sizes, waits = _counters(nodes, worker_of, order)
    lists = []
    for w in range(workers):
        insts = []
        for i in order[w]:
            pending = waits[i]
            while len(pending) > MAX_WAITS:
                insts.append(Inst(-1, tuple(pending[:MAX_WAITS]), -1))
                pending = pending[MAX_WAITS:]
            insts.append(Inst(i, tuple(pending), signal[i]))
        lists.append(tuple(insts))
    return Schedule(tuple(worker_of), tuple(lists), tuple(sizes), max(finish, default=0.0))


def _counters(nodes: list[NodeSpec], worker_of: list[int], order: list[list[int]]):
    succs: list[set[int]] = [set() for _ in nodes]
    for i, n in enumerate(nodes):
        for d in set(n.deps):
            succs[d].add(i)
    groups: dict[frozenset, list[int]] = {}
    for i, s in enumerate(succs):
        if s:
            groups.setdefault(frozenset(s), []).append(i)
    position = {i: k for lst in order for k, i in enumerate(lst)}
    members = list(groups.values())
    group_of = {i: g for g, m in enumerate(members) for i in m}
    waits: list[list[tuple[int, int]]] = []
    used: set[int] = set()
    for i, n in enumerate(nodes):
        mine = []
        for g in sorted({group_of[d] for d in n.deps}):
            local = all(worker_of[m] == worker_of[i] and position[m] < position[i] for m in members[g])
            if not local:
                mine.append(g)
                used.add(g)
        waits.append(mine)
    # Only counters someone waits on are kept (renumbered); the rest would be wasted atomics.
    number = {g: k for k, g in enumerate(sorted(used))}
    signal = [number.get(group_of.get(i, -1), -1) for i in range(len(nodes))]
    sizes = [len(members[g]) for g in sorted(used)]
    return signal, sizes, [[(number[g], len(members[g])) for g in w] for w in waits]
