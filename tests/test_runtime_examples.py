"""The runtime examples (tutorials that are tests) on the CPU executor, against torch."""

import pytest
import torch
from example_loader import load_example

import warploop


@pytest.fixture(scope="module")
def examples():
    return {name: load_example(name) for name in ("parallel_sort", "tree_reduce", "mlp_graph")}


def test_parallel_sort_matches_torch(examples):
    ps = examples["parallel_sort"]
    with warploop.Runtime(device="cpu", tasks=ps.TASKS, workers=3) as rt:
        torch.manual_seed(0)
        data = torch.randint(-50, 50, (300,)).float()        # duplicates, partial last run
        out = ps.sort(rt, data.clone(), timeout=120)
        assert torch.equal(out, torch.sort(data).values)


def test_tree_reduce_matches_float64(examples):
    tr = examples["tree_reduce"]
    with warploop.Runtime(device="cpu", tasks=tr.TASKS, workers=2) as rt:
        x = torch.randn(2000)
        total = tr.tree_sum(rt, x, timeout=120)
        assert abs(total - float(x.double().sum())) < 1e-3
        assert tr.tree_size(2000) == 15 and tr.tree_size(100) == 1


def test_mlp_graph_replays_match_torch(examples):
    mg = examples["mlp_graph"]
    with warploop.Runtime(device="cpu", tasks=mg.TASKS, workers=3) as rt:
        dim, hidden = 40, 72                                   # ragged tiles on both layers
        w1, w2 = torch.randn(hidden, dim) / dim ** 0.5, torch.randn(dim, hidden) / hidden ** 0.5
        h, y = torch.empty(hidden), torch.empty(dim)
        g = mg.build(rt, w1, w2, h, y)
        assert g.compile().counter_sizes == (5,)               # one counter: the 5 tiles of layer 1
        for _ in range(2):
            x = torch.randn(dim)
            y.fill_(float("nan"))
            g.run(x=x, timeout=120)
            ref = mg.reference(w1, w2, x)
            assert float((y - ref).norm() / ref.norm()) < 1e-5
