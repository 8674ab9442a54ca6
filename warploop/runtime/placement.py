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
import heapq

import numpy as np

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
    bounds: dict[int, tuple[int, int]] = {}       # id(deps) -> (lowest, highest): a stage's tiles share a tuple
    for i, n in enumerate(nodes):
        if n.deps:
            b = bounds.get(id(n.deps))
            if b is None:
                b = bounds[id(n.deps)] = (min(n.deps), max(n.deps))
        if n.deps and (b[0] < 0 or b[1] >= i):
            raise ValueError(f"node {i} depends on {n.deps}: dependencies must be recorded earlier")
        if n.worker is not None and not 0 <= n.worker < workers:
            raise ValueError(f"node {i} is pinned to worker {n.worker}, but there are {workers} workers")
        if n.cost < 0:
            raise ValueError(f"node {i} has negative cost {n.cost}")
    free = np.zeros(workers)
    counts = np.zeros(workers, dtype=np.int64)
    finish = np.zeros(len(nodes))
    worker_of = np.zeros(len(nodes), dtype=np.int64)
    order: list[list[int]] = [[] for _ in range(workers)]
    seen: dict[tuple[int, ...], np.ndarray] = {}   # deps -> ready per worker from them (a layer's tiles share one)
    i = 0
    while i < len(nodes):
        n = nodes[i]
        # Ready on w: its own free time, its own predecessors' latest finish, and the latest finish
        # of a predecessor on another worker plus a hop (the largest over the others: the top one,
        # or for the top one's worker the second).
        deps_ready = seen.get(n.deps)
        if deps_ready is None:
            latest = np.zeros(workers)
            if n.deps:
                d = np.asarray(n.deps)
                np.maximum.at(latest, worker_of[d], finish[d])
            top = int(np.argmax(latest))
            first = latest[top]
            second = np.max(np.delete(latest, top)) if workers > 1 else 0.0
            remote = np.full(workers, first)
            remote[top] = second
            deps_ready = np.maximum(latest, np.where(remote != 0, remote + hop, 0.0))
            seen[n.deps] = deps_ready
        run = _run_length(nodes, i)
        if run >= RUN_MIN:
            _place_run(range(i, i + run), n.cost, deps_ready, free, counts, finish, worker_of, order)
            i += run
            continue
        if n.worker is not None:
            w = n.worker
            ready = max(free[w], deps_ready[w])
        else:
            start = np.maximum(free, deps_ready)
            done = start + n.cost
            w = int(done.argmin())
            ties = done == done[w]
            if np.count_nonzero(ties) > 1:    # of those finishing first, the worker with the fewest nodes
                cand = np.flatnonzero(ties)
                w = int(cand[np.argmin(counts[cand])])
            ready = start[w]
        worker_of[i], finish[i], free[w] = w, ready + n.cost, ready + n.cost
        counts[w] += 1
        order[w].append(i)
        i += 1
    worker_of = [int(x) for x in worker_of]
    finish = finish.tolist()
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


RUN_MIN = 8     # consecutive nodes alike (a stage's tiles) placed by _place_run from this many on


def _run_length(nodes: list[NodeSpec], i: int) -> int:
    """How many nodes from i on share node i's deps and cost, none pinned (a stage's tiles)."""
    n = nodes[i]
    if n.worker is not None:
        return 1
    j = i + 1
    while (j < len(nodes) and nodes[j].worker is None and nodes[j].cost == n.cost
           and (nodes[j].deps is n.deps or nodes[j].deps == n.deps)):
        j += 1
    return j - i


def _place_run(run, cost: float, deps_ready, free, counts, finish, worker_of, order) -> None:
    """The one-node-at-a-time rule of place() for a run of alike nodes, with a heap of the workers
    keyed (finish if it went there, its node count, its index): the same pick, first finish, then
    fewest nodes, then the lowest index, in O(log workers) a node rather than a pass over them."""
    start = np.maximum(free, deps_ready)
    heap = [(float(start[w] + cost), int(counts[w]), w) for w in range(len(free))]
    heapq.heapify(heap)
    for i in run:
        done, count, w = heapq.heappop(heap)
        worker_of[i], finish[i], free[w] = w, done, done
        counts[w] = count + 1
        order[w].append(i)
        heapq.heappush(heap, (done + cost, count + 1, w))   # its free time is now past its deps' readiness


def _counters(nodes: list[NodeSpec], worker_of: list[int], order: list[list[int]]):
    # Nodes with one deps tuple form a class (a layer's tiles share one); a node's successors are
    # the members of the classes that list it, and classes are disjoint, so two nodes have the
    # same successors exactly when the same classes list them: work per distinct tuple, not per edge.
    classes: dict[tuple[int, ...], int] = {}
    class_of: list[int] = []                           # node -> its class (-1: no deps)
    same: dict[int, int] = {}                          # id(deps) -> class: a stage's tiles share one tuple
    listed: dict[int, list[int]] = {}                  # node -> the classes whose tuple holds it
    for n in nodes:
        c = same.get(id(n.deps))
        if c is None:
            c = same[id(n.deps)] = classes.get(n.deps, -1) if n.deps else -1
            if c < 0 and n.deps:
                c = same[id(n.deps)] = classes[n.deps] = len(classes)
                for d in set(n.deps):
                    listed.setdefault(d, []).append(c)
        class_of.append(c)
    groups: dict[tuple[int, ...], list[int]] = {}
    for i in sorted(listed):
        groups.setdefault(tuple(listed[i]), []).append(i)
    members = list(groups.values())
    group_of = np.full(len(nodes), -1)
    for g, m in enumerate(members):
        group_of[m] = g
    workers = np.asarray(worker_of)
    position = np.zeros(len(nodes), dtype=np.int64)
    for lst in order:
        position[lst] = np.arange(len(lst))
    # a group's signals are local to node i when all of them ran before it on its own worker: the
    # group's one worker (-1: several) and its last position there
    listed_nodes = np.flatnonzero(group_of >= 0)
    g_of = group_of[listed_nodes]
    low, high = np.full(len(members), len(order)), np.full(len(members), -1)
    last = np.full(len(members), -1)
    np.minimum.at(low, g_of, workers[listed_nodes])
    np.maximum.at(high, g_of, workers[listed_nodes])
    np.maximum.at(last, g_of, position[listed_nodes])
    home = np.where(low == high, low, -1)
    # each class's groups to wait on, node by node: the groups of its tuple less the local ones
    by_class = np.argsort(class_of, kind="stable")       # each class's members, in order
    bounds = np.searchsorted(np.asarray(class_of)[by_class], np.arange(len(classes) + 1))
    waits: list[list[int]] = [[] for _ in nodes]
    used: set[int] = set()
    for deps, c in classes.items():
        mine = by_class[bounds[c]:bounds[c + 1]]
        gs = np.unique(group_of[list(deps)])
        remote = (home[gs][None, :] != workers[mine][:, None]) | (last[gs][None, :] >= position[mine][:, None])
        used.update(gs[remote.any(0)].tolist())
        alike: dict[tuple[bool, ...], list[int]] = {}      # one list for the members that wait alike
        for i, row in zip(mine.tolist(), map(tuple, remote.tolist()), strict=True):
            w = alike.get(row)
            if w is None:
                w = alike[row] = [g for g, r in zip(gs.tolist(), row, strict=True) if r]
            waits[i] = w
    # Only counters someone waits on are kept (renumbered); the rest would be wasted atomics.
    number = {g: k for k, g in enumerate(sorted(used))}
    signal = [number.get(g, -1) for g in group_of.tolist()]
    sizes = [len(members[g]) for g in sorted(used)]
    counted = {g: (number[g], len(members[g])) for g in used}
    as_counters = {id(w): [counted[g] for g in w] for w in waits}     # once a shared list
    return signal, sizes, [as_counters[id(w)] for w in waits]
