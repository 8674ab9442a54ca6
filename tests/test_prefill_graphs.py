"""Prefill CUDA graphs (cuda_graphs.PrefillGraphs, WARPLOOP_PREFILL_GRAPHS): the plan buffer a graph
reads at fixed capacities, which batches a graph takes, and the setting's checks. The padded forward
itself runs in test_llm_kernels.py (the interpreter child, and natively on a GPU)."""
from __future__ import annotations

import pytest
import torch

from warploop.llm import paged_attention
from warploop.llm.backend import ModelBatch
from warploop.llm.paged_attention import plan_ints, plan_size


def test_plan_ints_fill_spare_blocks_with_an_empty_sequence():
    bm = paged_attention.PREFILL_BM
    tables, qlens, ctxs = [[3, 4], [7]], [bm + 5, 9], [bm + 5, 14]
    ints = plan_ints(tables, qlens, ctxs, blocks=5, seqs=4, width=3)
    assert len(ints) == plan_size(5, 4, 3)
    nb, b = 5, 4
    blk_seq, blk_row = ints[:nb], ints[nb:2 * nb]
    q_start, q_len, ctx = ints[2 * nb:2 * nb + b], ints[2 * nb + b:2 * nb + 2 * b], ints[2 * nb + 2 * b:2 * nb + 3 * b]
    assert blk_seq == [0, 0, 1, 3, 3] and blk_row == [0, bm, 0, 0, 0]    # spares: the last sequence slot
    assert q_start == [0, bm + 5, 0, 0] and q_len == [bm + 5, 9, 0, 0] and ctx == [bm + 5, 14, 0, 0]
    assert ints[2 * nb + 3 * b:] == [3, 4, 0, 7, 0, 0] + [0] * 6
    # the exact plan PrefillPlan makes has no spares, and the same fields
    exact = plan_ints(tables, qlens, ctxs, blocks=3, seqs=2, width=2)
    assert exact == [0, 0, 1, 0, bm, 0, 0, bm + 5, bm + 5, 9, bm + 5, 14, 3, 4, 7, 0]


def test_plan_ints_refuses_what_does_not_fit():
    with pytest.raises(ValueError, match="does not fit"):
        plan_ints([[0]], [3], [3], blocks=0, seqs=2, width=1)             # no block for the sequence
    with pytest.raises(ValueError, match="does not fit"):
        plan_ints([[0]], [3], [3], blocks=2, seqs=1, width=1)             # a spare block and no spare sequence
    with pytest.raises(ValueError, match="does not fit"):
        plan_ints([[0, 1]], [3], [20], blocks=1, seqs=2, width=1)         # a table wider than the buffer's
    with pytest.raises(ValueError, match="at least one token"):
        plan_ints([[0]], [0], [3], blocks=1, seqs=2, width=1)


def test_prefill_graphs_take_small_prefills_only():
    """A graph takes a prefill of up to PREFILL_SEQS sequences and its token capacity, with the last
    rows' logits; decode steps, wider batches, prompt logprobs and ids already on a device run eagerly."""
    from warploop.llm.backend_torch import TorchBackend
    from warploop.llm.cuda_graphs import PREFILL_SEQS, PrefillGraphs
    from warploop.llm.kv_cache import KVCacheLayout
    from warploop.llm.shapes import CPU_MODELS
    from warploop.llm.weights import random_weights

    cfg = CPU_MODELS["small-cpu"][1]
    layout = KVCacheLayout(cfg.num_layers, 16, 16, cfg.num_kv_heads, cfg.head_dim, "float32")
    backend = TorchBackend(cfg, random_weights(cfg, torch.device("cpu"), torch.float32), layout, "cpu", max_context=256)
    graphs = PrefillGraphs(backend, 100)
    assert graphs.buckets == [64, 100]

    def batch(qlens, **kw):
        ids = [1] * sum(qlens)
        return ModelBatch(ids, [0] * len(ids), qlens, qlens, [[i] for i in range(len(qlens))], **kw)

    assert graphs.fits(batch([40, 60]))
    assert not graphs.fits(batch([50, 51]))                       # past the capacity
    assert not graphs.fits(batch([2] * (PREFILL_SEQS + 1)))       # more sequences than a graph takes
    assert not graphs.fits(batch([1, 1]))                         # a decode step (DecodeGraphs' work)
    assert not graphs.fits(batch([5], logits_indices=[0, 4]))     # prompt logprobs: every row's logits
    assert not graphs.fits(ModelBatch(torch.ones(5, dtype=torch.int32), [0] * 5, [5], [5], [[0]]))


def test_prefill_graphs_setting_is_checked(monkeypatch):
    from warploop import config

    try:
        monkeypatch.setenv("WARPLOOP_PREFILL_GRAPHS", "2048")
        assert config.reload().prefill_graphs == 2048
        for bad, match in (("-1", "use 0"), ("99999", "up to 16384"), ("lots", "not a whole number")):
            monkeypatch.setenv("WARPLOOP_PREFILL_GRAPHS", bad)
            with pytest.raises(ValueError, match=f"WARPLOOP_PREFILL_GRAPHS.*{match}"):
                config.reload()
    finally:
        monkeypatch.delenv("WARPLOOP_PREFILL_GRAPHS")
        config.reload()


def test_staging_alternates_host_buffers_and_copies_what_was_filled():
    """cuda_graphs.Staging (both graph kinds' inputs): two host buffers in turn, each send copying the
    first `used` values of the one just filled into the device buffer, and nothing past them."""
    from warploop.llm.cuda_graphs import Staging

    st = Staging(6, torch.device("cpu"))
    first = st.host()
    first[:] = [1, 2, 3, 4, 5, 6]
    st.send(3)
    assert st.dev.tolist() == [1, 2, 3, 0, 0, 0]
    second = st.host()
    assert second is not first and second.base is not first.base
    second[:] = 9
    st.send(2)
    assert st.dev.tolist() == [9, 9, 3, 0, 0, 0] and st.host().tolist() == [1, 2, 3, 4, 5, 6]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("backend", ["torch", "stream", "megakernel"])
def test_engine_prefills_through_graphs_by_default_on_a_gpu(monkeypatch, backend):
    """With no setting, an engine on a GPU prefills prompts of up to 2,048 tokens through PrefillGraphs
    (the stream and megakernel backends through their per-op half), and its tokens are those of
    WARPLOOP_PREFILL_GRAPHS=0."""
    from warploop import config
    from warploop.llm.engine import Engine, SamplingParams

    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = [list(range(1, 40)), list(range(7, 300)), list(range(3, 120))]

    def run():
        with Engine.from_model("tiny", device="cuda", backend=backend, dtype="bfloat16", progress=False) as engine:
            per_op = getattr(engine.backend, "per_op", engine.backend)
            graphs = per_op.prefill_graphs
            tokens = [engine.generate(p, params).token_ids for p in prompts]
            return tokens, graphs and (graphs.max_tokens, graphs.runs)

    monkeypatch.delenv("WARPLOOP_PREFILL_GRAPHS", raising=False)
    config.reload()
    try:
        graphed, seen = run()
        assert seen is not None and seen[1] >= len(prompts), seen
        monkeypatch.setenv("WARPLOOP_PREFILL_GRAPHS", "0")
        config.reload()
        eager, off = run()
        assert off is None
        assert graphed == eager
    finally:
        monkeypatch.delenv("WARPLOOP_PREFILL_GRAPHS", raising=False)
        config.reload()
