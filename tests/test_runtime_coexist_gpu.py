"""The resident runtime beside torch and other CUDA work, as a user meets it (skipped without a GPU).

Each case is a fresh process (CUDA reads CUDA_MODULE_LOADING once, at start-up) that opens a
Runtime and then runs work that loads never-used kernels and synchronises the context; a deadline
turns a hang into a failure.
"""
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

import warploop
from warploop.bench.runtime_kernels import tick

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
CHILD = Path(__file__).with_name("coexist_child.py")
ROOT = CHILD.parents[1]


@pytest.mark.parametrize("loading", ["unset", "LAZY", "EAGER"])
@pytest.mark.parametrize("order", ["runtime-first", "torch-first"])
def test_torch_work_completes_beside_an_open_runtime(loading, order):
    env = {k: v for k, v in os.environ.items() if k != "CUDA_MODULE_LOADING"}
    if loading != "unset":
        env["CUDA_MODULE_LOADING"] = loading
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    p = subprocess.run([sys.executable, str(CHILD), order], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]
    assert "ok device_sync" in p.stdout and "done" in p.stdout, p.stdout


def test_park_handshake_under_racing_submits():
    """Park at every idle moment while two threads submit: every submission must still run."""
    counter = torch.zeros(1, dtype=torch.int32, device="cuda")
    with warploop.Runtime(tasks=[tick], park_after_us=0, timeout=30) as rt:
        errors = []

        def submitter(n, batch):
            try:
                for _ in range(n // batch):    # a batch of submits, then a wait on all of them
                    for f in [rt.submit(tick, counter) for _ in range(batch)]:
                        f.result(timeout=30)
            except Exception as e:      # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=submitter, args=(1500, batch)) for batch in (1, 5)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not errors, errors
        relaunches = rt._backend.relaunches
    assert int(counter.item()) == 3000
    assert relaunches > 10


def test_graph_runs_across_parks():
    """A graph replayed with the kernel parked between runs: every relaunched worker must see the
    next run (workers start from the runs seen at the park, not from a run counter the front may
    already have bumped)."""
    import time

    x = torch.zeros(64, dtype=torch.int32, device="cuda")
    with warploop.Runtime(tasks=[tick], park_after_us=0, timeout=30) as rt:
        g = rt.graph()
        for i in range(64):
            g.add(tick, x[i:i + 1], worker=i % rt.workers)
        for _ in range(20):
            g.run(timeout=30)
            deadline = time.perf_counter() + 1.0
            while not rt._backend.parked() and time.perf_counter() < deadline:
                time.sleep(1e-4)
        relaunches = rt._backend.relaunches
    assert torch.equal(x.cpu(), torch.full((64,), 20, dtype=torch.int32))
    assert relaunches >= 10
