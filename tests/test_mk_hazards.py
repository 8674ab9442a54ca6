"""Static hazard check of the decode graphs (no GPU, nothing runs on the graph itself).

The CPU executor runs a graph in one fixed legal order, so a missing dependency edge only shows
as a race on a GPU. Here every RAW, WAR and WAW pair of nodes is checked against the edges and
the placement, for every graph the builder makes: the tiny model, the two random test configs,
batches 1, 3 and 32, Llama-3.2-1B shapes, with the CPU and the GPU plan and several worker
counts; then the declared footprints (hazards.py) are checked against the loads and stores the
interpreter really makes, so the static check cannot pass on a wrong declaration.
"""
import collections
import dataclasses
import itertools

import pytest
from mk_helpers import LLAMA_GQA, QWEN3_LIKE, backends, model_weights, run_steps

from warploop.llm.loader import load_config, resolve_model_dir
from warploop.llm.mk.graph import StepBuffers, build_decode_graph
from warploop.llm.mk.hazards import Access, check, graph_accesses, hazards, unrealised_edges
from warploop.llm.mk.plans import plan_for
from warploop.llm.mk.tasks import tasks_for
from warploop.llm.shapes import LLAMA_3_2_1B
from warploop.llm.weights import LayerWeights, ModelWeights
from warploop.runtime import Runtime


def addressed_graph(cfg, device_type: str, batch: int, workers: int, block_size: int = 16, width: int = 64, **plan):
    """The decode graph of `cfg` with a distinct fake address per buffer (nothing is allocated)."""
    plan = plan_for(cfg, "bfloat16", block_size, device_type, **plan)
    tasks = tasks_for(plan)
    fresh = (n << 32 for n in itertools.count(1))
    layers = [LayerWeights(*(next(fresh) if name not in ("qkv_bias", "o_bias", "gate_up_bias", "down_bias",
                                                          "q_norm", "k_norm") else None
                             for name in LayerWeights.__dataclass_fields__)) for _ in range(cfg.num_layers)]
    weights = ModelWeights(next(fresh), layers, next(fresh), next(fresh))
    kv = collections.defaultdict(lambda: next(fresh))
    buffers = StepBuffers(*(next(fresh) for _ in dataclasses.fields(StepBuffers)))
    with Runtime(device="cpu", workers=workers, tasks=tasks.all) as rt:
        dg = build_decode_graph(rt, tasks, plan, cfg, weights, kv, next(fresh), next(fresh), buffers, batch, width,
                                workers)
        dg.graph.descriptors()          # placement and counters only
    return dg, plan


CONFIGS = {"tiny": lambda: load_config(resolve_model_dir("tiny")), "llama_gqa": lambda: LLAMA_GQA,
           "qwen3_like": lambda: QWEN3_LIKE}


@pytest.mark.parametrize("device_type, workers", [("cpu", 4), ("cuda", 4), ("cuda", 131), ("cuda", 263)])
@pytest.mark.parametrize("batch", [1, 3, 32])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_small_graphs_have_every_conflict_ordered(name, batch, device_type, workers):
    dg, plan = addressed_graph(CONFIGS[name](), device_type, batch, workers)
    found = hazards(dg, plan)
    assert not found, "\n".join(h.describe(dg.labels) for h in found[:10])
    assert unrealised_edges([n.deps for n in dg.graph.nodes], dg.graph.schedule) == []


def test_llama_1b_graph_with_one_fused_attention_node_per_group_and_row_has_every_conflict_ordered():
    # 256 KB tiles: this is about the attention nodes; the default plan's whole graphs are checked
    # below (its 64 KB tiles make ~39,000 nodes: 40 s of checking each)
    dg, plan = addressed_graph(LLAMA_3_2_1B, "cuda", 3, 131, splits=1, tile_kb=256)
    assert dg.kinds["rope_attn"] == 16 * 8 * 3 and not dg.kinds["attn"]      # per layer, group and row
    found = hazards(dg, plan)
    assert not found, "\n".join(h.describe(dg.labels) for h in found[:10])
    assert unrealised_edges([n.deps for n in dg.graph.nodes], dg.graph.schedule) == []


@pytest.mark.parametrize("batch, workers", [(1, 263), (32, 263)])
def test_llama_1b_graph_has_every_conflict_ordered(batch, workers):
    """The default GPU plan (64 KB tiles, every slot of an H100 a worker), batch 1 and 32."""
    dg, plan = addressed_graph(LLAMA_3_2_1B, "cuda", batch, workers, width=256)
    assert len(dg.graph) > 8000
    found = hazards(dg, plan)
    assert not found, "\n".join(h.describe(dg.labels) for h in found[:10])
    assert unrealised_edges([n.deps for n in dg.graph.nodes], dg.graph.schedule) == []


def test_a_removed_edge_is_reported_as_a_race():
    # o_proj tiles need every combine: drop one, and the o_proj tile races the attention output.
    # 4 KB tiles: several o_proj nodes, so the others still order the next layer after that
    # combine. (With 32 KB tiles this model's o_proj is one node, and dropping its edge rightly
    # shows races all down the next layer too.)
    dg, plan = addressed_graph(LLAMA_GQA, "cuda", 1, 131, tile_kb=4)
    assert dg.kinds["o_proj"] > LLAMA_GQA.num_layers
    nodes = dg.graph.nodes
    o = dg.labels.index("o_proj")
    deps = [n.deps for n in nodes]
    dropped = deps[o][0]
    assert dg.labels[dropped] == "combine"
    deps[o] = deps[o][1:]
    accesses = graph_accesses(dg, plan)
    workers = list(range(len(nodes)))           # every node on a worker of its own
    found = check(deps, workers, accesses)
    # the attention output it reads, and the residual rows it writes while group 0's qkv tiles read them
    assert ("RAW", dropped, o) in [(h.kind, h.first, h.second) for h in found]
    assert {h.second for h in found} == {o} and {h.kind for h in found} == {"RAW", "WAR"}
    # ... unless they share a worker, whose list order then orders them
    assert check(deps, [0] * len(nodes), accesses) == []


def test_check_orders_rows_against_every_row_accesses():
    """Accesses of one batch row meet those of the same row and of every row, not of other rows."""
    every_w, every_r = Access(1, 0, 8, True), Access(1, 0, 8, False)
    row0_w, row1_w, row0_r = Access(1, 0, 8, True, 0), Access(1, 0, 8, True, 1), Access(1, 0, 8, False, 0)
    unordered = [(), (), (), ()]
    # two rows written by unordered nodes: no conflict; a later read of every row meets both
    found = check(unordered, [0, 1, 2, 3], [[every_r], [row0_w], [row1_w], [every_r]])
    assert {(h.kind, h.first, h.second) for h in found} == {("WAR", 0, 1), ("WAR", 0, 2), ("RAW", 1, 3),
                                                            ("RAW", 2, 3)}
    # ordered: the writes after the first read, the last read after both writes
    assert check([(), (0,), (0,), (1, 2)], [0, 1, 2, 3], [[every_r], [row0_w], [row1_w], [every_r]]) == []
    # a row read after a write of every row meets it; a row read of another row after a row write does not
    found = check([(), (), ()], [0, 1, 2], [[every_w], [row1_w], [row0_r]])
    assert {(h.kind, h.first, h.second) for h in found} == {("WAW", 0, 1), ("RAW", 0, 2)}


def test_check_finds_war_and_waw():
    a = Access(1, 0, 8, False)
    w = Access(1, 4, 12, True)
    found = check([(), (), ()], [0, 1, 2], [[a], [w], [w]])
    assert {(h.kind, h.first, h.second) for h in found} == {("WAR", 0, 1), ("WAW", 1, 2)}
    assert check([(), (0,), (1,)], [0, 1, 2], [[a], [w], [w]]) == []


def test_unrealised_edges_names_a_dependency_the_schedule_drops():
    dg, _ = addressed_graph(LLAMA_GQA, "cuda", 1, 131)
    deps = [n.deps for n in dg.graph.nodes]
    last = len(deps) - 1                        # the sample combine
    deps[last] = deps[last] + (0,)              # the embedding: no counter of it is waited on there
    assert unrealised_edges(deps, dg.graph.schedule) == [(0, last)]


@pytest.mark.parametrize("splits", [4, 1], ids=["splits4", "one_split_fused"])
@pytest.mark.parametrize("cfg", [LLAMA_GQA, QWEN3_LIKE], ids=["llama_gqa", "qwen3_like"])
def test_declared_footprints_cover_every_load_and_store(cfg, splits):
    """Run a batch-3 step (GPU plan: 4 splits, 16-row tiles) on the CPU executor, recording each
    node's loads and stores of the graph's buffers and KV cache; each must be declared."""
    from interp_recorder import recorded_accesses

    ref, mk = backends(cfg, model_weights(cfg), max_num_seqs=4, blocks=256, splits=splits, bn=16, bk=256, workers=7)
    try:
        dg = mk.graphs[4]
        with recorded_accesses(mk, dg) as log:
            run_steps(ref, mk, [list(range(1, 131)), [7, 8, 9], [11] * 20], steps=1, seed=1)
        assert mk.last is dg
        declared = graph_accesses(dg, mk.plan)
        # every node touched memory but the attention nodes of the bucket's fourth row, not live
        idle = set(range(len(declared))) - set(log)
        assert idle and all({a.row for a in declared[n]} == {3} for n in idle)
        rows_seen = collections.Counter()
        for node, seen in log.items():
            for buffer, write, column, row in seen:
                assert any(a.buffer == buffer and a.write == write and a.lo <= column < a.hi
                           and (a.row < 0 or row < 0 or a.row == row) for a in declared[node]), \
                    (f"node {node} ({dg.labels[node]}) {'writes' if write else 'reads'} row {row} column {column} "
                     f"of buffer {buffer:#x}, outside its declared footprint")
                rows_seen[dg.labels[node], row] += row >= 0 and any(a.row >= 0 for a in declared[node])
        # the attention nodes were checked row by row: each of the 3 live rows by its own nodes
        assert {row for (_, row), n in rows_seen.items() if n} == {0, 1, 2}
    finally:
        mk.close()
