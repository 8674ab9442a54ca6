"""Static graphs: placement, counters and NOP join points, then real runs on the CPU executor."""
import numpy as np
import pytest
import torch
import triton
import triton.language as tl

import warploop
from warploop.runtime.descriptor import MAX_WAITS
from warploop.runtime.placement import Inst, NodeSpec, Schedule, place


@warploop.task(signature={"log": "*i32", "cursor": "*i32", "node": "i32"})
@triton.jit
def record(log, cursor, node):
    """Append `node` to the log: the log is the order nodes ran in."""
    tl.store(log + tl.atomic_add(cursor, 1), node)


@warploop.task(signature={"x": "*fp32", "i": "i32", "s": "fp32"})
@triton.jit
def bump(x, i, s):
    """x[i] = x[i-1] + s (x[0] += s): each node reads its predecessor's output."""
    prev = tl.load(x + tl.maximum(i - 1, 0))
    tl.store(x + i, tl.where(i == 0, tl.load(x) + s, prev + s))


@warploop.task(signature={"count": "*i32", "limit": "i32", "halt": "*i32"})
@triton.jit
def count_to(count, limit, halt):
    """count[0] += 1; once it reaches `limit`, end the graph request (its halt word)."""
    n = tl.load(count) + 1
    tl.store(count, n)
    if n >= limit:
        tl.store(halt, 1)


def test_chain_stays_on_one_worker_without_counters():
    s = place([NodeSpec(deps=(i - 1,) if i else ()) for i in range(10)], workers=4)
    assert len(set(s.worker_of)) == 1
    assert s.counter_sizes == ()
    assert all(inst.waits == () and inst.signal == -1 for lst in s.lists for inst in lst)


def test_wide_layers_spread_and_share_one_counter():
    layer1 = [NodeSpec() for _ in range(8)]
    layer2 = [NodeSpec(deps=tuple(range(8))) for _ in range(8)]
    s = place(layer1 + layer2, workers=4)
    assert sorted(s.worker_of[:8]) == [0, 0, 1, 1, 2, 2, 3, 3]
    assert s.counter_sizes == (8,)
    for lst in s.lists:
        for inst in lst:
            assert inst.signal == (0 if inst.node < 8 else -1)
            assert inst.waits == (((0, 8),) if inst.node >= 8 else ())
    # every worker list is in recording (topological) order
    assert all([i.node for i in lst] == sorted(i.node for i in lst) for lst in s.lists)


def test_more_than_two_waits_become_nop_join_points():
    # a, b, c have different successor sets (each also feeds its own follower), so three counters
    nodes = [NodeSpec(worker=w) for w in range(3)] + [NodeSpec(deps=(w,), worker=w) for w in range(3)]
    nodes.append(NodeSpec(deps=(0, 1, 2), worker=3))
    s = place(nodes, workers=4)
    assert s.counter_sizes == (1, 1, 1)
    nop, last = s.lists[3]
    assert nop.node == -1 and len(nop.waits) == 2 and nop.signal == -1
    assert last.node == 6 and len(last.waits) == 1
    assert {w for w, _ in nop.waits + last.waits} == {0, 1, 2}


def test_cost_balances_load():
    s = place([NodeSpec(cost=4.0)] + [NodeSpec(cost=1.0) for _ in range(4)], workers=2)
    assert s.worker_of[0] != s.worker_of[1] and len(set(s.worker_of[1:])) == 1
    assert s.makespan == 4.0


@pytest.mark.parametrize("bad, match", [([NodeSpec(deps=(0,))], "recorded earlier"),
                                        ([NodeSpec(worker=5)], "pinned"), ([NodeSpec(cost=-1)], "negative")])
def test_place_rejects_bad_graphs(bad, match):
    with pytest.raises(ValueError, match=match):
        place(bad, workers=2)


@pytest.fixture(scope="module")
def rt():
    with warploop.Runtime(device="cpu", tasks=[record, bump, count_to], workers=3) as runtime:
        yield runtime


def test_graph_runs_respect_dependencies_across_workers(rt):
    log, cursor = torch.full((21,), -1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    g = rt.graph()
    first = [g.add(record, log, cursor, i, worker=i) for i in range(3)]
    second = [g.add(record, log, cursor, 3 + i, after=first, worker=(i + 1) % 3) for i in range(3)]
    g.add(record, log, cursor, 6, after=second, worker=0)
    g.run()
    order = log[:7].tolist()
    assert sorted(order[:3]) == [0, 1, 2] and sorted(order[3:6]) == [3, 4, 5] and order[6] == 6
    counters = g._tensors[2].numpy()
    assert counters.tolist() == [3, 3]                    # one counter per layer, one run
    g.run(repeat=2)
    assert counters.tolist() == [9, 9] and int(cursor) == 21   # epochs: counters never reset


def test_a_node_ends_its_request_early_and_the_next_request_runs_in_full(rt):
    count, log, cursor = torch.zeros(1, dtype=torch.int32), torch.full((64,), -1, dtype=torch.int32), \
        torch.zeros(1, dtype=torch.int32)
    g = rt.graph()
    limit = g.param("limit", "i32")
    first = [g.add(record, log, cursor, i, worker=i) for i in range(3)]
    g.add(count_to, count, limit, g.halt_address(), after=first)
    g.run(repeat=10, limit=3)
    assert int(count) == 3 and int(cursor) == 9          # three whole runs, then the request ended
    g.run(repeat=4, limit=100)                           # the halt word is cleared per request
    assert int(count) == 7 and int(cursor) == 21
    g.run(repeat=5, limit=8)                             # halts on its first run: run 8 in all
    assert int(count) == 8 and int(cursor) == 24


def test_graph_parameters_replay_with_new_scalars(rt):
    x = torch.zeros(4)
    g = rt.graph()
    step = g.param("step", "fp32")
    nodes = []
    for i in range(4):
        nodes.append(g.add(bump, x, i, step, after=nodes[-1:], worker=i % 3))   # a chain across workers
    g.run(step=1.0)
    assert x.tolist() == [1.0, 2.0, 3.0, 4.0]
    g.run(step=0.5)
    assert x.tolist() == [1.5, 2.0, 2.5, 3.0]
    descs, table = g.descriptors()
    assert np.sum(table[1::2]) == len(descs) == 4
    assert all(d.param_mask == 0b100 and d.args[2] == 0 for d in descs)


def test_graph_api_errors(rt):
    g = rt.graph()
    p = g.param("p", "i32")
    with pytest.raises(TypeError, match="is i32, but"):
        g.add(bump, torch.zeros(1), 0, p)
    with pytest.raises(TypeError, match="missing"):
        g.launch()
    g.add(bump, torch.zeros(1), p, 1.0)
    g.run(p=0)
    with pytest.raises(RuntimeError, match="compiled"):
        g.add(bump, torch.zeros(1), 0, 1.0)


def test_pipelined_worker_loop_runs_a_chain_with_parameters():
    """The resident loop itself, in the interpreter: run_graph loads each instruction's words while
    the one before runs, and decodes a parameter argument from them; replays see new values."""
    with warploop.Runtime(device="cpu", tasks=[record, bump], workers=1) as rt:
        x = torch.zeros(5)
        g = rt.graph()
        step = g.param("step", "fp32")
        nodes = []
        for i in range(5):
            nodes.append(g.add(bump, x, i, step, after=nodes[-1:]))
        run = g.launch(step=1.0)
        rt._backend.run_resident_inline()
        assert run.done() and x.tolist() == [1.0, 2.0, 3.0, 4.0, 5.0]
        run = g.launch(repeat=2, step=0.5)
        rt._backend.run_resident_inline()
        assert run.done() and x.tolist() == [2.0, 2.5, 3.0, 3.5, 4.0]
        assert g.schedule.counter_sizes == ()
        # A second graph, then the first again: the worker's cache of a graph's words must follow
        # the released graph, not the last one it ran.
        y = torch.zeros(3)
        g2 = rt.graph()
        for i in range(3):
            g2.add(bump, y, i, 10.0)
        runs = [g2.launch(), g.launch(step=1.0), g2.launch()]
        rt._backend.run_resident_inline()
        assert all(r.done() for r in runs)
        assert y.tolist() == [20.0, 30.0, 40.0] and x.tolist() == [3.0, 4.0, 5.0, 6.0, 7.0]


def test_hop_bench_chains_one_worker_by_default_and_every_worker_pinned():
    from warploop.bench.runtime_hop import chain
    from warploop.bench.runtime_kernels import HOP_TASKS
    with warploop.Runtime(device="cpu", tasks=HOP_TASKS, workers=4) as rt:
        for pinned, workers, counters in ((False, 1, 0), (True, 4, 11)):
            x = torch.zeros(12, dtype=torch.int32)
            g = chain(rt, x, 12, pinned)
            g.run(repeat=2)
            assert x.tolist() == [2 + i for i in range(12)]
            assert len(set(g.schedule.worker_of)) == workers and len(g.schedule.counter_sizes) == counters


# -- placement at scale: the vectorised place() gives the schedule of the plain list scheduler ---------
# The scheduler as it was written first (one Python loop over workers per node, one set per edge),
# kept here as the reference: place() must return exactly its schedule, only faster.
def reference_place(nodes: list[NodeSpec], workers: int, hop: float = 0.5) -> Schedule:
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
    signal, sizes, waits = _reference_counters(nodes, worker_of, order)
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


def _reference_counters(nodes: list[NodeSpec], worker_of: list[int], order: list[list[int]]):
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


def test_place_matches_the_reference_list_scheduler_on_random_graphs():
    import random

    rng = random.Random(7)
    for trial in range(30):
        n, workers = rng.randint(1, 120), rng.randint(1, 9)
        nodes = []
        for i in range(n):
            pool = list(range(i))
            deps = tuple(sorted(rng.sample(pool, min(len(pool), rng.choice([0, 1, 2, 5, 40]))))) if pool else ()
            if i > 3 and rng.random() < 0.3:
                deps = nodes[i - 1].deps       # shared tuples: a layer's tiles
            pinned = rng.randrange(workers) if rng.random() < 0.1 else None
            nodes.append(NodeSpec(deps, float(rng.choice([0, 1, 1, 2.5, 100])), pinned))
        assert place(nodes, workers) == reference_place(nodes, workers), f"trial {trial}"


def test_place_puts_a_stages_tiles_where_the_one_at_a_time_rule_does():
    """Runs of alike nodes (a stage's tiles: one deps tuple, one cost, none pinned) go through the
    heap of placement._place_run: the reference's placement, ties and all, on stages wider and
    narrower than the workers, with costs that tie and pinned nodes between them."""
    import random

    rng = random.Random(11)
    for trial in range(20):
        workers = rng.choice([1, 3, 8, 132])
        nodes, prev = [NodeSpec((), 1.0)], (0,)
        for _ in range(rng.randint(2, 6)):
            start = len(nodes)
            cost = float(rng.choice([0, 1, 2.5, 32768]))
            nodes += [NodeSpec(prev, cost) for _ in range(rng.choice([1, 7, 8, 9, 50, 300]))]
            if rng.random() < 0.3:
                nodes.append(NodeSpec(prev, cost, rng.randrange(workers)))
            prev = tuple(range(start, len(nodes))) if rng.random() < 0.7 else (len(nodes) - 1,)
        assert place(nodes, workers) == reference_place(nodes, workers), f"trial {trial}"


def test_place_takes_a_tiled_decode_step_in_seconds():
    """A Llama-1B step of GEMV tiles (38k nodes, all-to-all between stages) on 263 workers: 8.6 s
    for the reference scheduler on this machine class, about 1 s now."""
    import time

    nodes, prev = [NodeSpec((), 1.0)], (0,)
    for _ in range(16):
        for count, cost in ((192, 32768), (8, 100), (32, 1000), (8, 100), (128, 32768), (1024, 32768), (512, 32768)):
            start = len(nodes)
            nodes += [NodeSpec(prev, float(cost)) for _ in range(count)]
            prev = tuple(range(start, start + count))
    nodes += [NodeSpec(prev, 32768.0) for _ in range(8016)]
    # CPU time of this process, not wall time: the same figure on an idle machine (place is
    # single-threaded), but not stretched by other processes sharing the cores (CI runs the suite on
    # both of its cores, beside a test that compiles in two more processes)
    t0 = time.process_time()
    schedule = place(nodes, 263)
    assert time.process_time() - t0 < 5.0
    assert sum(len(lst) for lst in schedule.lists) >= len(nodes)
