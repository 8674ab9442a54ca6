"""The resident kernel on a real GPU, diffed against the CPU executor (skipped without a GPU).

Most inputs are made before a runtime opens, as this file always did; tests/test_runtime_coexist_gpu.py
and tests/test_examples_gpu.py make them after, as users do.
"""
import json
import time

import pytest
import torch
import triton
import triton.language as tl
from example_loader import load_example

import warploop
from warploop.runtime import device as wl
from warploop.runtime.descriptor import TaskDescriptor
from warploop.runtime.errors import TaskError

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@warploop.task(signature={"x": "*i32"})
@triton.jit
def self_join(ctx, x):
    wl.join(ctx, wl.task_id(ctx))
    tl.store(x, 1)


@warploop.task(signature={"x": "*i32"})
@triton.jit
def bump(x):
    tl.atomic_add(x, 1)


@warploop.task(signature={"x": "*i32", "out": "*i32", "i": "i32"})
@triton.jit
def snap(x, out, i):
    tl.store(out + i, tl.load(x, volatile=True))


@warploop.task(signature={"x": "*i32", "n": "i32"})
@triton.jit
def fan_out(ctx, x, n):
    for _ in range(n):
        wl.spawn(ctx, bump, x)


def run_examples(device: str, data: dict) -> dict:
    ps, tr, mg = load_example("parallel_sort"), load_example("tree_reduce"), load_example("mlp_graph")
    d = {k: v.to(device) for k, v in data.items()}
    out = {}
    with warploop.Runtime(device=device, tasks=ps.TASKS + tr.TASKS + mg.TASKS, workers=4) as rt:
        tmp = torch.empty_like(d["sort"])
        where = rt.submit(ps.parallel_sort, d["sort"], tmp, d["sort"].numel()).result(timeout=20)
        out["sort"] = (d["sort"] if where == 1 else tmp).cpu()
        tree = d["tree"]
        rt.submit(tr.reduce, d["x"], tree, 0, 0, d["x"].numel()).result(timeout=20)
        out["tree"] = tree.cpu()
        g = mg.build(rt, d["w1"], d["w2"], d["h"], d["y"])
        g.run(x=d["xin"], timeout=20)
        out["h"], out["y"] = d["h"].cpu(), d["y"].cpu()
    return out


def test_examples_match_the_cpu_executor():
    torch.manual_seed(1)
    data = {"sort": torch.randint(-99, 99, (700,)).float(), "x": torch.randn(3000), "tree": torch.zeros(31),
            "w1": torch.randn(96, 48) / 7, "w2": torch.randn(48, 96) / 10, "h": torch.zeros(96), "y": torch.zeros(48),
            "xin": torch.randn(48)}
    ref, gpu = run_examples("cpu", data), run_examples("cuda", data)
    assert torch.equal(gpu["sort"], ref["sort"]) and torch.equal(ref["sort"], torch.sort(data["sort"]).values)
    assert torch.allclose(gpu["tree"], ref["tree"], rtol=1e-5, atol=1e-4)
    for name in ("h", "y"):
        assert torch.allclose(gpu[name], ref[name], rtol=1e-4, atol=1e-5), name


def test_graph_chain_across_all_workers_and_trace(tmp_path):
    mg = load_example("mlp_graph")
    x = torch.zeros(1, dtype=torch.int32, device="cuda")
    with warploop.Runtime(device="cuda", tasks=[bump, *mg.TASKS], trace=True) as rt:
        g = rt.graph()
        prev = []
        for i in range(3 * rt.workers):                       # every hop crosses to the next worker
            prev = [g.add(bump, x, after=prev, worker=i % rt.workers)]
        g.run(repeat=5, timeout=20)
        assert int(x.cpu()) == 15 * rt.workers
        rt.save_trace(str(tmp_path / "trace.json"))
    events = [e for e in json.loads((tmp_path / "trace.json").read_text())["traceEvents"] if e["ph"] == "X"]
    assert len(events) == 15 * rt.workers
    assert all(e["dur"] >= 0 for e in events)


def test_a_stage_run_on_one_worker_releases_every_signal_once():
    """Four nodes of one stage back to back on each worker (same waits, same counter) release their
    signals together (worker.run_inst): the next stage still sees every one, on every run, and each
    counter ends at its signals per run times the runs."""
    x = torch.zeros(1, dtype=torch.int32, device="cuda")
    with warploop.Runtime(device="cuda", tasks=[bump, snap]) as rt:
        w = rt.workers
        out = torch.full((w,), -1, dtype=torch.int32, device="cuda")
        g = rt.graph()
        first = [g.add(bump, x, worker=i % w) for i in range(4 * w)]
        for i in range(w):
            g.add(snap, x, out, i, after=first, worker=(i + 1) % w)
        g.run(repeat=3, timeout=20)
        assert out.cpu().tolist() == [12 * w] * w
        sizes = list(g.schedule.counter_sizes)
        assert sizes and g._tensors[2].cpu().tolist()[:len(sizes)] == [3 * n for n in sizes]


def test_dynamic_fan_out_and_bad_opcode():
    x = torch.zeros(1, dtype=torch.int32, device="cuda")
    with warploop.Runtime(device="cuda", tasks=[bump, fan_out]) as rt:
        rt.submit(fan_out, x, 3000).result(timeout=20)
        assert int(x.cpu()) == 3000
        with pytest.raises(TaskError, match="invalid opcode"):
            rt.submit_descriptor(TaskDescriptor(opcode=4242)).result(timeout=10)
        futures = [rt.submit(bump, x) for _ in range(600)]   # more than the submit ring holds
        for f in futures:
            f.result(timeout=30)
        assert int(x.cpu()) == 3600


def test_close_after_a_hung_task_leaves_the_gpu_usable():
    x, y = torch.zeros(1, dtype=torch.int32, device="cuda"), torch.zeros(1, dtype=torch.int32, device="cuda")
    rt = warploop.Runtime(device="cuda", tasks=[self_join, bump])
    with pytest.raises(TimeoutError) as info:
        rt.submit(self_join, x).result(timeout=2)
    assert "joining" in str(info.value) and "self_join" in str(info.value)
    rt.close(timeout=1)                                     # cannot drain: aborts the join
    torch.cuda.synchronize()                                # the resident kernel has ended
    assert float(torch.ones(1000, device="cuda").sum()) == 1000.0
    with warploop.Runtime(device="cuda", tasks=[bump]) as again:
        again.submit(bump, y).result(timeout=10)
    assert int(y.cpu()) == 1


def test_flag_synchronised_mlp_stack_matches_fp32_and_replays_bit_for_bit():
    """The MLP bench's per-tile flag variant (no graph edges: tiles wait on each other's flags, and
    each prefetches its next tile into L2), two layers: right against fp32, and replays (the flags
    count runs) give the same bits."""
    from warploop.bench import runtime_gpu as rg
    w1, w2, x0 = rg.mlp_weights(torch, 2)
    ref = rg.reference(torch, w1, w2, x0)
    out = rg.runtime_mlp(torch, w1, w2, x0, repeat=3, variant="worker_tile_flags_pf1")
    assert out["sync"] == "flags"
    assert rg.rel_err(torch, out["warploop_out"], ref) < 0.05
    assert torch.equal(out["replay_out"], out["warploop_out"])


def test_park_frees_the_gpu_now_and_the_next_submit_relaunches():
    """A runtime on every SM that would stay resident for a minute idle: park() returns once the
    kernel has exited, a context-wide synchronisation then completes at once, and the next
    submission launches the kernel again with its state."""
    x = torch.zeros(1, dtype=torch.int32, device="cuda")
    with warploop.Runtime(tasks=[bump], park_after_us=60e6, timeout=30) as rt:
        rt.submit(bump, x).result(timeout=10)
        t0 = time.perf_counter()
        assert rt.park(timeout=10) is True
        torch.cuda.synchronize()                 # would wait out the 60 s idle time without the park
        assert time.perf_counter() - t0 < 5
        rt.submit(bump, x).result(timeout=10)
        assert int(x.item()) == 2
