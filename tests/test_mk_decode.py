"""The decode megakernel on the CPU executor (the Triton interpreter): the same greedy tokens as
the per-op backend, for random Llama- and Qwen3-like models, at batch 1 and batch > 1 with
different context lengths, and the tiny model at batch 2 (through the engine: test_mk_engine.py)."""
import dataclasses

import pytest
import torch
from mk_helpers import LLAMA_GQA, QWEN3_LIKE, backends, model_weights, run_steps

from warploop.llm.backend import ModelBatch
from warploop.llm.mk.backend import MegakernelBackend
from warploop.llm.mk.graph import BATCH_TILES, build_decode_graph
from warploop.llm.mk.layout import Plan

LLAMA_TAIL = dataclasses.replace(LLAMA_GQA, intermediate_size=72)


def check(steps, tol=1e-4):
    for i, (got, want, graph_argmax) in enumerate(steps):
        assert got.shape == want.shape
        err = float((got - want).abs().max() / want.abs().max())
        assert err < tol, f"step {i}: logits relative error {err:.2e}"
        assert got.argmax(-1).tolist() == want.argmax(-1).tolist(), f"step {i}: greedy tokens differ"
        assert graph_argmax == got.argmax(-1).tolist(), f"step {i}: the graph's argmax disagrees with its logits"


@pytest.mark.parametrize("cfg", [LLAMA_GQA, QWEN3_LIKE], ids=["llama_gqa_untied_llama3rope", "qwen3_qknorm_bias_tied"])
def test_random_models_match_per_op_backend_batch_1_and_3(cfg):
    ref, mk = backends(cfg, model_weights(cfg), max_num_seqs=4)
    try:
        # two steps: the second reads KV the graph wrote, and a row's context enters a new 4-token block
        check(run_steps(ref, mk, [[3, 1, 4, 1, 5, 9, 2]], steps=2))
        # three sequences (bucket 4: one padding row), one long enough to split its attention over
        # both splits (130 tokens > one 64-token tile per split), one spanning few blocks
        prompts = [list(range(1, 131)), [7, 8, 9], [11] * 20]
        check(run_steps(ref, mk, prompts, steps=2, seed=1))
    finally:
        mk.close()


def test_one_split_runs_each_groups_attention_as_one_node():
    """splits=1: rope, attention and the combine of a KV head group in one node (rope_attn); Qwen3's
    q/k norm and biases, batch 1 and 3 with one context of 130 tokens (three 64-token tiles)."""
    cfg = QWEN3_LIKE
    ref, mk = backends(cfg, model_weights(cfg), max_num_seqs=4, splits=1)
    try:
        kinds = mk.graphs[1].kinds
        assert kinds["rope_attn"] == cfg.num_layers * cfg.num_kv_heads
        assert not kinds["attn"] and not kinds["rope_kv"] and not kinds["combine"]
        check(run_steps(ref, mk, [[3, 1, 4, 1, 5, 9, 2]], steps=2))
        check(run_steps(ref, mk, [list(range(1, 131)), [7, 8, 9], [11] * 20], steps=2, seed=1))
    finally:
        mk.close()


def check_gemv_tiles(mk, cfg, tiles: dict, depth: int) -> None:
    """The plan's tile constexprs and depth, and the batch-1 graph's gate_up and lm_head nodes (one a tile)."""
    got = mk.plan.tile_constexprs()
    assert {k: got[k] for k in tiles} == tiles and mk.plan.constexprs()["DEPTH"] == depth
    nodes = mk.graphs[1].kinds
    assert nodes["gate_up"] == cfg.num_layers * cfg.intermediate_size // tiles["TNS"]
    assert nodes["lm_head"] == -(-cfg.vocab_size // tiles["TND"])


def test_gemv_tiles_match_per_op_backend():
    """The GPU's GEMV tiles (Plan.tile_kb: one node per tile of rows, at most 8 chunks in
    straight-line code, the first `depth` before the wait) on the interpreter, 4 KB tiles of fp32:
    [16, 16] chunks. Qwen3-like: qkv 4 chunks, gate_up 8 (gate and up), o_proj 8, all 8 issued before
    the wait (depth 8, the GPU default). Batch 2 takes the tl.dot blocks inside each tile. The
    Llama-like tail config at depth 4 (down's 5 chunks ending in a masked tail) is the next test's:
    the same plan and steps, and more rows."""
    cfg = QWEN3_LIKE
    ref, mk = backends(cfg, model_weights(cfg), max_num_seqs=2, bn=16, bk=32, hidden=cfg.hidden_size,
                       inter=cfg.intermediate_size, tile_kb=4, depth=8, workers=3)
    try:
        check_gemv_tiles(mk, cfg, {"TND": 16, "TKD": 16, "TNS": 8, "TKS": 16, "TNQ": 8, "TKQ": 16}, 8)
        check(run_steps(ref, mk, [[3, 1, 4, 1, 5, 9, 2]], steps=2))
        check(run_steps(ref, mk, [[5, 6, 7], list(range(1, 40))], steps=2, seed=2))
    finally:
        mk.close()


def test_batch_graphs_give_each_gemv_node_several_tiles():
    """GEMV tiles of the Llama-like config with intermediate size 72, 4 KB tiles of fp32 ([16, 16]
    chunks), the first 4 before the wait (depth 4): down's 5 chunks end in a masked tail. In the
    graphs of more than one row a GEMV node owns BATCH_TILES (2) tiles (its rows through
    tl.dot blocks), also where that does not divide the rows (intermediate 72 in 8-row gate_up tiles:
    9 tiles, the last node's second tile past the end); the batch-1 graph keeps one tile a node.
    Tokens equal the per-op backend's at batches 1, 2 and 3. batch_tiles is no option any more."""
    cfg = LLAMA_TAIL
    ref, mk = backends(cfg, model_weights(cfg), max_num_seqs=4, bn=16, bk=32, hidden=cfg.hidden_size,
                       inter=cfg.intermediate_size, tile_kb=4, depth=4, workers=3)
    try:
        check_gemv_tiles(mk, cfg, {"TND": 16, "TKD": 16, "TNS": 8, "TNF": 8, "TKF": 16}, 4)
        assert BATCH_TILES == 2
        t = mk.plan.tile_constexprs()
        one, more = mk.graphs[1].kinds, mk.graphs[2].kinds
        assert one["down"] == cfg.num_layers * cfg.hidden_size // t["TNF"]
        assert cfg.intermediate_size // t["TNS"] % 2 == 1
        for kind, tn, rows in (("down", "TNF", cfg.hidden_size), ("gate_up", "TNS", cfg.intermediate_size),
                               ("qkv", "TND", cfg.q_size + 2 * cfg.kv_size)):
            assert more[kind] == mk.graphs[4].kinds[kind] == cfg.num_layers * -(-rows // (2 * t[tn])), kind
        check(run_steps(ref, mk, [[3, 1, 4, 1, 5, 9, 2]], steps=2))
        check(run_steps(ref, mk, [[5, 6, 7], list(range(1, 40))], steps=2, seed=2))
        check(run_steps(ref, mk, [[5, 6, 7], list(range(1, 20)), [9] * 11], steps=2, seed=3))
    finally:
        mk.close()
    with pytest.raises(TypeError, match="batch_tiles"):
        MegakernelBackend(cfg, model_weights(cfg), ref.layout, "cpu", 64, batch_tiles=2)


def test_batch_1_on_a_kernel_of_its_own_matches_per_op_backend():
    """batch1_kernel: the batch-1 graph runs on a resident kernel compiled for it alone (Plan.one_row:
    row tiles without a batch path), the others on a second kernel (with it); a step on one
    runtime after a step on the other gives the per-op backend's tokens, both ways, and each graph
    belongs to its own runtime. A one-row plan refuses the graph of more rows."""
    cfg = LLAMA_TAIL
    ref, mk = backends(cfg, model_weights(cfg), max_num_seqs=2, bn=16, bk=32, hidden=cfg.hidden_size,
                       inter=cfg.intermediate_size, tile_kb=4, workers=3, batch1_kernel=True)
    try:
        assert mk.plan.one_row == 1 and mk.plan.constexprs()["ONE"] == 1
        assert not mk.plan_many.one_row and mk.plan_many.constexprs()["ONE"] == 0
        assert mk.plan_many == dataclasses.replace(mk.plan, one_row=0)
        assert mk.rt is not mk.rt_many and mk.runtimes == [mk.rt, mk.rt_many]
        assert mk.graphs[1].graph.runtime is mk.rt and mk.graphs[2].graph.runtime is mk.rt_many
        assert "qkv" in mk.graphs[1].kinds and "qkv" in mk.graphs[2].kinds
        check(run_steps(ref, mk, [[3, 1, 4, 1, 5, 9, 2]], steps=1))
        check(run_steps(ref, mk, [[5, 6, 7], list(range(1, 40))], steps=2, seed=2))
        check(run_steps(ref, mk, [[8, 8, 2, 7]], steps=1, seed=3))
        with pytest.raises(ValueError, match="a batch-1 kernel's plan"):
            build_decode_graph(mk.rt, mk.tasks, mk.plan, cfg, mk.w, mk.kv, mk.cos, mk.sin, mk.graphs[2].buffers,
                               2, mk.width, 3)
    finally:
        mk.close()
    with pytest.raises(ValueError, match="needs GEMV tiles"):
        MegakernelBackend(cfg, model_weights(cfg), ref.layout, "cpu", 64, batch1_kernel=True)
    with pytest.raises(ValueError, match="use batch1_kernel"):
        MegakernelBackend(cfg, model_weights(cfg), ref.layout, "cpu", 64, one_row=1)
    with pytest.raises(ValueError, match="Plan.one_row .* needs GEMV tiles"):
        Plan("bf16", 4, 2, 64, 16, one_row=1)


def test_batches_past_graph_rows_run_per_op():
    """graph_rows: decode batches of more sequences than that run on the per-op path (through CUDA
    graphs on a GPU), smaller ones on the graph; both give the per-op backend's tokens."""
    cfg = LLAMA_GQA
    ref, mk = backends(cfg, model_weights(cfg), max_num_seqs=4, graph_rows=1)
    try:
        assert mk.buckets == [1] and set(mk.graphs) == {1}
        check(run_steps(ref, mk, [[3, 1, 4, 1, 5, 9, 2]], steps=2))
        assert mk.last is mk.graphs[1]
        one = mk.last
        prompts, tables = [[5, 6, 7], list(range(1, 12))], [[40, 41], [50, 51, 52, 53]]
        lens = [len(p) for p in prompts]
        prefill = ModelBatch([t for p in prompts for t in p], [i for p in prompts for i in range(len(p))], lens,
                             lens, tables)
        ids = ref.forward(prefill).argmax(-1).tolist()
        mk.forward(prefill)
        step = ModelBatch(ids, lens, [1, 1], [n + 1 for n in lens], tables)
        got, want = mk.forward(step).clone(), ref.forward(step).clone()
        assert mk.last is one       # no graph ran
        assert float((got - want).abs().max()) == 0.0       # the same per-op computation
    finally:
        mk.close()
    with pytest.raises(ValueError, match="graph_rows=-1"):
        MegakernelBackend(cfg, model_weights(cfg), ref.layout, "cpu", 64, graph_rows=-1)


def test_short_contexts_take_the_fused_attention_graph_and_long_ones_the_split_graph():
    """fused_upto: a bucket holds two graphs over the same buffers, one attention node per (row,
    group) for steps whose longest context is at most fused_upto tokens, Plan.splits nodes and a
    combine beyond; each step takes its form and both give the per-op backend's tokens."""
    cfg = LLAMA_GQA
    ref, mk = backends(cfg, model_weights(cfg), max_num_seqs=2, fused_upto=9)
    try:
        assert mk.plan.splits == 2 and set(mk.fused) == set(mk.graphs)
        assert mk.fused[1].kinds["rope_attn"] == cfg.num_layers * cfg.num_kv_heads and "attn" not in mk.fused[1].kinds
        assert mk.graphs[1].kinds["attn"] == cfg.num_layers * cfg.num_kv_heads * 2
        assert mk.fused[1].buffers is mk.graphs[1].buffers
        forms = []
        real = mk.decode

        def spy(batch, *a, **k):
            out = real(batch, *a, **k)
            forms.append(("fused" if mk.last is mk.fused[1] else "split", max(batch.context_lens)))
            return out
        mk.decode = spy
        check(run_steps(ref, mk, [[3, 1, 4, 1, 5, 9, 2]], steps=4))    # contexts 8 .. 11
        assert forms == [("fused", 8), ("fused", 9), ("split", 10), ("split", 11)]
        # the decode loop picks the form for its last step's context
        assert mk.graph_for(1, 9) is mk.fused[1] and mk.graph_for(1, 10) is mk.graphs[1]
        assert mk.graph_for(2, 3) is mk.fused[2]
    finally:
        mk.close()
    with pytest.raises(ValueError, match="fused_upto=-1"):
        MegakernelBackend(cfg, model_weights(cfg), ref.layout, "cpu", 64, fused_upto=-1)


def test_warmup_compiles_the_batch_1_graph_before_the_first_step():
    """A single request's first decode step must not pay the graph's placement (thousands of
    nodes on a GPU plan): warmup places and uploads the batch-1 graph; larger buckets wait for use."""
    cfg = LLAMA_GQA
    ref, mk = backends(cfg, model_weights(cfg), max_num_seqs=2)
    try:
        assert mk.graphs[1].graph.schedule is not None and mk.graphs[1].graph._tensors is not None
        assert mk.graphs[2].graph.schedule is None
    finally:
        mk.close()


class StaticOutput:
    """A backend whose forward returns one reused buffer, as the per-op backend's CUDA-graph replay
    does on a GPU (a view of the graph's static output): valid only until the next forward."""

    def __init__(self, inner) -> None:
        self.inner, self.layout, self.out = inner, inner.layout, None

    def forward(self, batch):
        logits = self.inner.forward(batch)
        if self.out is None or self.out.shape != logits.shape:
            self.out = torch.empty_like(logits)
        return self.out.copy_(logits)


def test_run_steps_keeps_each_steps_logits_from_a_reused_output_buffer():
    """The GPU test compared step 0's megakernel logits with the per-op logits of the last step: the
    CUDA-graph output was overwritten by every later step before the comparison."""
    ref, mk = backends(LLAMA_GQA, model_weights(LLAMA_GQA), max_num_seqs=1)
    try:
        steps = run_steps(StaticOutput(ref), mk, [[3, 1, 4, 1, 5]], steps=3)
        check(steps)
        assert steps[0][1].data_ptr() != steps[1][1].data_ptr()
        assert not torch.equal(steps[0][1], steps[2][1])
    finally:
        mk.close()


def test_tiny_model_batch_of_two_matches_per_op_backend():
    from warploop.llm.loader import load_config, load_weights, resolve_model_dir

    path = resolve_model_dir("tiny")
    cfg = load_config(path)
    weights = load_weights(path, cfg, torch.device("cpu"), torch.bfloat16, progress=False)
    ref, mk = backends(cfg, weights, max_num_seqs=2, block_size=16, blocks=32, max_context=512)
    try:
        prompts = [list(b"import os\nimport sys\n"), list(b"def f(x):\n    return x")]
        check(run_steps(ref, mk, [[t + 4 for t in p] for p in prompts], steps=2), tol=2e-2)
    finally:
        mk.close()


def test_a_slow_start_says_it_is_compiling(monkeypatch, capsys):
    """The first start of a model shape compiles the resident kernel (minutes on a GPU): past
    COMPILE_NOTICE_S it says so on stderr rather than look hung; a quick start says nothing."""
    import time

    from warploop.llm.mk import backend as mk_backend
    from warploop.runtime import Runtime

    def slow(*args, **kwargs):
        time.sleep(0.3)
        return Runtime(*args, **kwargs)

    monkeypatch.setattr("warploop.runtime.Runtime", slow)
    monkeypatch.setattr(mk_backend, "COMPILE_NOTICE_S", 0.05)
    ref, mk = backends(LLAMA_GQA, model_weights(LLAMA_GQA), max_num_seqs=1)
    mk.close()
    assert mk_backend.COMPILE_NOTICE in capsys.readouterr().err
    monkeypatch.setattr(mk_backend, "COMPILE_NOTICE_S", 60.0)
    ref, mk = backends(LLAMA_GQA, model_weights(LLAMA_GQA), max_num_seqs=1)
    mk.close()
    assert mk_backend.COMPILE_NOTICE not in capsys.readouterr().err


def test_warm_prefill_touches_only_block_0_and_changes_no_later_result():
    """TorchBackend.warm_prefill (run by warmup on a GPU, for both backends): a throwaway prefill
    into KV block 0, after which a real sequence, even one given block 0, gets the same logits."""
    cfg = LLAMA_GQA
    w = model_weights(cfg)
    ref, mk = backends(cfg, w, max_num_seqs=1)
    mk.close()
    fresh, _ = backends(cfg, w, max_num_seqs=1)
    before = ref.kv.clone()
    ref.warm_prefill()
    changed = (ref.kv != before).flatten(3).any(-1)          # [layers, k/v, blocks]
    assert changed[:, :, 0].all() and not changed[:, :, 1:].any()
    from warploop.llm.backend import ModelBatch
    batch = ModelBatch([3, 1, 4, 1, 5], list(range(5)), [5], [5], [[0, 1]])
    assert torch.equal(ref.forward(batch), fresh.forward(batch))
