"""Suite-wide hooks.

Under pytest-xdist (CI runs `-n 2 --dist worksteal` on 2 cores) the tests that take minutes on such a
machine are collected first, so one worker starts them at once while the other works through the rest
of the suite, and work stealing evens out what is left. A test that started last would run alone at
the end instead: the whole decode kernel's compile takes about two minutes a target on one core with
an empty Triton cache (three targets, one test each). Without xdist the order is pytest's own.

Marks, applied here so that they hold for every file (pyproject.toml registers them):
- `gpu`: every test of a tests/test_*_gpu.py module, and every test that skips for want of a GPU
  (a skipif whose reason names a GPU, CUDA or Hopper). Without a GPU they skip; `-m gpu` runs
  the GPU tests on the device machine, `-m "not gpu"` the rest.
- `slow`: the tests in START_FIRST (minutes each on CI's cores) and any marked in their file
  (installs, large conversions); `-m "not slow"` is the quick loop.
"""
from __future__ import annotations

import functools
import os
import re

import pytest


def _share_the_cores() -> None:
    """Under pytest-xdist, each worker's math libraries get its share of the cores, not all of them.

    torch (OpenMP) and NumPy's BLAS start a thread per core in every process, and their threads
    spin while they wait for each other. With CI's two workers on two cores, four such threads
    took turns on two cores: a test of small torch ops took 70 s beside another worker's, 9 s
    with one thread each. Set before torch or NumPy is imported (this file is imported first);
    the subprocesses tests start (servers, interpreter children) inherit it. A value the caller
    set is kept."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    if workers < 1:
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = str(max(1, cores // workers))
    for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(name, threads)


_share_the_cores()

# node ids (with or without parameters), longest first. Only tests that share no module-scoped fixture:
# one moved away from its module's other tests would set that fixture up a second time.
START_FIRST = (
    "tests/test_mk_compile.py::test_resident_decode_kernel_compiles_without_a_gpu",
)


GPU_REASON = re.compile(r"\b(GPU|CUDA|cuda|Hopper|HIP)\b")


@functools.cache
def has_gpu() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def needs_gpu(item) -> bool:
    return (re.fullmatch(r"test_.*_gpu\.py", item.path.name) is not None
            or any(GPU_REASON.search(str(m.kwargs.get("reason", ""))) for m in item.iter_markers("skipif")))


def pytest_itemcollected(item):
    """The marks, as each test is collected (before `-m` selects by them)."""
    if item.get_closest_marker("gpu") is None and needs_gpu(item):
        item.add_marker(pytest.mark.gpu)
    if item.get_closest_marker("gpu") is not None and not has_gpu():
        item.add_marker(pytest.mark.skip(reason="needs a GPU"))
    if item.nodeid.split("[", 1)[0] in START_FIRST:
        item.add_marker(pytest.mark.slow)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    if not hasattr(config, "workerinput"):  # an xdist worker (each collects; the controller does not)
        return
    rank = {node_id: i for i, node_id in enumerate(START_FIRST)}

    def key(item):
        node_id = item.nodeid
        return rank.get(node_id, rank.get(node_id.split("[", 1)[0], len(rank)))

    items.sort(key=key)  # stable: everything else keeps its order
