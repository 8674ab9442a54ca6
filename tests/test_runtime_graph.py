"""Static graphs: placement, counters and NOP join points, then real runs on the CPU executor."""
import numpy as np
import pytest
import torch
import triton
import triton.language as tl

import warploop
from warploop.runtime.placement import NodeSpec, place


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
    with warploop.Runtime(device="cpu", tasks=[record, bump], workers=3) as runtime:
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
