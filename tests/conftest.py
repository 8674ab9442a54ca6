"""Suite-wide hooks.

Under pytest-xdist (CI runs `-n 2 --dist worksteal` on 2 cores) the tests that take minutes on such a
machine are collected first, so one worker starts them at once while the other works through the rest
of the suite, and work stealing evens out what is left. A test that started last would run alone at
the end instead: the whole decode kernel's compile takes about two minutes a target on one core with
an empty Triton cache (three targets, one test each). Without xdist the order is pytest's own.
"""
from __future__ import annotations

import pytest

# node ids (with or without parameters), longest first. Only tests that share no module-scoped fixture:
# one moved away from its module's other tests would set that fixture up a second time.
START_FIRST = (
    "tests/test_mk_compile.py::test_resident_decode_kernel_compiles_without_a_gpu",
)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    if not hasattr(config, "workerinput"):  # an xdist worker (each collects; the controller does not)
        return
    rank = {node_id: i for i, node_id in enumerate(START_FIRST)}

    def key(item):
        node_id = item.nodeid
        return rank.get(node_id, rank.get(node_id.split("[", 1)[0], len(rank)))

    items.sort(key=key)  # stable: everything else keeps its order
