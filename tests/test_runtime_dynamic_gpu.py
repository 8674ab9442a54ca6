"""Dynamic work at any size on a real GPU (skipped without one): the 1M-task fan-out and depth-20
recursion through the default 4096-slot pool, joins and then-chains through a 2-slot pool.

Tensors may be made before or after a Runtime opens: the kernel parks when idle, so CUDA work that
synchronises the context completes beside it (docs/runtime.md, tests/test_runtime_coexist_gpu.py).
"""
import pytest
import torch
from test_runtime_inline import TASKS, chain, entries, spawn_join, spawn_n

import warploop
from warploop.bench.runtime_fanout import split

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def clean(rt) -> bool:
    status = rt.status()
    return status.pending == () and status.issued == status.completed and status.error is None


def test_a_million_task_fanout_through_the_default_pool():
    out = torch.zeros(1, dtype=torch.int32, device="cuda")
    with warploop.Runtime(tasks=[split]) as rt:
        assert rt.layout.pool == 4096
        rt.submit(split, out, 0, 1 << 19).result(timeout=120)       # 1,048,575 tasks
        assert clean(rt)
    assert int(out.cpu()[0]) == 1 << 19


def test_recursion_depth_20_through_the_default_pool():
    out = torch.zeros(1, dtype=torch.int32, device="cuda")
    with warploop.Runtime(tasks=[split]) as rt:
        rt.submit(split, out, 0, 1 << 20).result(timeout=240)       # a binary tree 20 deep: 2,097,151 tasks
        assert clean(rt)
    assert int(out.cpu()[0]) == 1 << 20


def test_inline_children_join_and_then_chains_through_a_two_slot_pool():
    log, cursor = torch.full((64,), -1, dtype=torch.int32, device="cuda"), torch.zeros(1, dtype=torch.int32,
                                                                                        device="cuda")
    log2, cursor2 = torch.full((16,), -1, dtype=torch.int32, device="cuda"), torch.zeros(1, dtype=torch.int32,
                                                                                          device="cuda")
    links = torch.zeros(1, dtype=torch.int64, device="cuda")
    with warploop.Runtime(tasks=TASKS, pool=2) as rt:
        rt.submit(spawn_n, log, cursor, 5).result(timeout=60)
        rt.submit(spawn_join, log2, cursor2).result(timeout=60)
        # Structured completion keeps every link alive until its continuation completes, so a chain
        # needs about a slot per link: 50 fit the spawning worker's reserve (256 slots by default).
        rt.submit(chain, 50, links).result(timeout=60)
        assert clean(rt)
    with warploop.Runtime(tasks=TASKS) as rt:        # the default pool: a long chain
        rt.submit(chain, 2000, links).result(timeout=60)
        assert clean(rt)
    # Which children go inline depends on timing here (a child on the ring may finish and free its
    # slot before the next spawn); the exact order is checked on the CPU executor.
    assert sorted(t for t, _ in entries(log.cpu(), cursor.cpu())) == [0, 10, 11, 12, 13, 14]
    joined = [t for t, _ in entries(log2.cpu(), cursor2.cpu())]
    assert sorted(joined) == [0, 1, 2, 3] and joined.index(2) < joined.index(3)
    assert int(links.cpu()[0]) == (2 * 50 + 1) + (2 * 2000 + 1)
