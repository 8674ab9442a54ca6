"""`fanout_tasks_per_s`: a 1M-task binary fan-out through the default 4096-slot pool.

Each task splits its range of leaves in two and spawns both halves, down to one leaf per task:
2 x leaves - 1 tasks (1,048,575 for 2^19 leaves), far more than the pool holds. Tasks spawned
while the pool is full run inline on their spawner, depth first (docs/runtime.md, "Dynamic work at
any size"), so the run needs no larger pool. The peer, in the same run, is the flat fan-out of
`warploop bench runtime` (`tasks_per_s`: a spawner per worker, 1000 tiny tasks each, through a
2^18-slot pool that holds them all, every task through the shared ring).

    python -m warploop.bench.runtime_fanout [LEAVES]        # one JSON object
"""
from __future__ import annotations

import time

import triton
import triton.language as tl

import warploop
from warploop.bench.common import emit, header
from warploop.bench.runtime_kernels import HOP_TASKS, spawn_tree
from warploop.runtime import device as wl

DEFAULT_LEAVES = 1 << 19        # 1,048,575 tasks
DEFAULT_POOL = 4096             # Runtime's default: the point is that it suffices
FLAT_POOL = 1 << 18             # the peer's pool: room for every task it spawns
FLAT_EACH = 1000                # ticks per spawner in the peer (as in runtime_gpu.runtime_tasks)


@warploop.task(signature={"out": "*i32", "lo": "i32", "hi": "i32"})
@triton.jit
def split(ctx, out, lo, hi):
    """One task per node of a binary tree over the leaves [lo, hi); each leaf adds 1 to out."""
    if hi - lo > 1:
        mid = (lo + hi) // 2
        wl.spawn(ctx, split, out, lo, mid)
        wl.spawn(ctx, split, out, mid, hi)
    else:
        tl.atomic_add(out, 1, sem="relaxed")


def timed_fanout(rt, torch, counter, leaves: int, timeout: float) -> tuple[float, bool]:
    """Seconds from submit to result for a fan-out over `leaves`; whether every leaf ran once."""
    before = int(counter.cpu()[0])
    t0 = time.perf_counter()
    rt.submit(split, counter, 0, leaves).result(timeout=timeout)
    elapsed = time.perf_counter() - t0
    return elapsed, int(counter.cpu()[0]) - before == leaves


def fanout_figures(torch, leaves: int = DEFAULT_LEAVES, pool: int = DEFAULT_POOL, device: str | None = None,
                   timeout: float = 300.0) -> dict:
    """The fan-out's tasks/s through `pool` slots, and the flat peer's in the same run.

    Tensors are made before each Runtime opens (a resident kernel may hold every SM).
    """
    tasks = 2 * leaves - 1
    dev = "cuda" if device is None and torch.cuda.is_available() else (device or "cpu")
    counter = torch.zeros(1, dtype=torch.int32, device=dev)
    flat = torch.zeros(1, dtype=torch.int32, device=dev)
    with warploop.Runtime(device=dev, tasks=[split], pool=pool) as rt:
        timed_fanout(rt, torch, counter, min(leaves, 1024), timeout)          # warm-up
        elapsed, ok = timed_fanout(rt, torch, counter, leaves, timeout)
        status = rt.status()
        workers = rt.workers
    fig = {"fanout_tasks": tasks, "fanout_pool": pool, "fanout_workers": workers, "fanout_s": elapsed,
           "fanout_tasks_per_s": tasks / elapsed, "fanout_ok": ok and status.issued == status.completed}
    # The peer: `warploop bench runtime`'s tasks_per_s setup (one 1-warp worker per SM, a spawner per
    # worker, FLAT_EACH ticks each, a pool that holds them all: every task through the shared ring).
    peer_workers = torch.cuda.get_device_properties(0).multi_processor_count if dev == "cuda" else workers
    with warploop.Runtime(device=dev, tasks=HOP_TASKS, workers=peer_workers, worker_warps=1, pool=FLAT_POOL) as rt:
        fan, each = rt.workers, min(FLAT_EACH, max(1, tasks // rt.workers))
        rt.submit(spawn_tree, flat, fan, 1).result(timeout=timeout)           # warm-up
        before = int(flat.cpu()[0])
        t0 = time.perf_counter()
        rt.submit(spawn_tree, flat, fan, each).result(timeout=timeout)
        flat_s = time.perf_counter() - t0
        flat_ok = int(flat.cpu()[0]) - before == fan * each
    flat_tasks = fan * each + fan + 1
    fig.update({"flat_tasks": flat_tasks, "flat_pool": FLAT_POOL, "flat_workers": fan,
                "flat_tasks_per_s": flat_tasks / flat_s, "flat_ok": flat_ok})
    fig["fanout_vs_flat"] = fig["fanout_tasks_per_s"] / fig["flat_tasks_per_s"]
    return fig


def main() -> int:
    import sys

    import torch

    leaves = int(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_LEAVES
    emit(header("runtime-fanout") | fanout_figures(torch, leaves))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
