"""The decode graph on a device against the same nodes on the CPU executor, tensor by tensor
(tests/mk_diff.py): each tile kind alone, the whole graph on one worker, the whole graph across
every worker. On the CPU both sides are the interpreter (a check of the harness and of the
graph's independence from placement); on a GPU (skips without one) it localises a wrong result.
float32 throughout, where the GPU's code paths round exactly as the interpreter's.
"""
import os

import pytest

os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")   # lazy loading synchronises beside a resident kernel

import torch  # noqa: E402
from mk_diff import diff, prime  # noqa: E402
from mk_helpers import LLAMA_GQA, model_weights  # noqa: E402

from warploop.llm.kv_cache import KVCacheLayout  # noqa: E402
from warploop.llm.mk.backend import MegakernelBackend  # noqa: E402
from warploop.llm.mk.plans import GPU_PLAN  # noqa: E402
from warploop.runtime import Runtime  # noqa: E402

TOL = 1e-4
CONTEXTS = {1: [6], 4: [5, 130, 20]}     # live rows per bucket: one or all four splits of 64 in use
CPU_RESULTS: dict = {}      # the CPU executor's side of whole-graph diffs, by nodes and starting state


@pytest.fixture(scope="module", params=["cpu", "cuda"])
def pair(request):
    """(megakernel backend on the device with the GPU plan, CPU executor with the same tasks)."""
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    cfg = LLAMA_GQA
    layout = KVCacheLayout(cfg.num_layers, 256, 4, cfg.num_kv_heads, cfg.head_dim, "float32")
    workers = 7 if request.param == "cpu" else None
    mk = MegakernelBackend(cfg, model_weights(cfg, device=request.param), layout, request.param, 256,
                           workers=workers, graph_rows=0, **GPU_PLAN)
    mk.warmup(4)
    cpu = Runtime(device="cpu", workers=1, tasks=list(dict.fromkeys(mk.tasks.all + mk.tasks_many.all)))
    try:
        yield mk, cpu
    finally:
        cpu.close()
        mk.close()


def report(what, errors):
    bad = {k: v for k, v in errors.items() if not v <= TOL}
    print(f"\n{what}: " + ", ".join(f"{k} {v:.1e}" for k, v in sorted(errors.items()) if v))
    return bad


@pytest.mark.parametrize("bucket", [1, 4])
def test_each_tile_kind_alone_matches_the_cpu_executor(pair, bucket):
    mk, cpu = pair
    dg = mk.graphs[bucket]
    bad = {}
    for kind in dict.fromkeys(dg.labels):
        node = dg.graph.nodes[dg.labels.index(kind)]
        prime(mk, dg, CONTEXTS[bucket], seed=len(kind))
        errors = report(f"{kind} alone, batch {len(CONTEXTS[bucket])}", diff(mk, dg, cpu, [node]))
        bad.update({f"{kind}: {k}": v for k, v in errors.items()})
    assert not bad, f"tile kinds that differ from the CPU executor: {bad}"


@pytest.mark.parametrize("bucket", [1, 4])
@pytest.mark.parametrize("placement", ["one worker", "every worker"])
def test_whole_graph_matches_the_cpu_executor(pair, bucket, placement):
    mk, cpu = pair
    dg = mk.graphs[bucket]
    prime(mk, dg, CONTEXTS[bucket], seed=bucket)
    # both placements start from one state: the CPU executor's side runs once for the two
    errors = diff(mk, dg, cpu, dg.graph.nodes, worker=0 if placement == "one worker" else None,
                  reference=CPU_RESULTS)
    bad = report(f"whole graph on {placement}, batch {len(CONTEXTS[bucket])}", errors)
    assert not bad, f"buffers that differ from the CPU executor: {bad}"
