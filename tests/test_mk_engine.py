"""The decode megakernel through the engine on the CPU executor: the tokens of the torch backend
with a prefix-cache hit, with a sequence preempted between graph steps, and with batch 1 on the
graph while larger batches run per op (graph_rows)."""
import threading

import pytest
from mk_helpers import LLAMA_GQA, model_weights

from warploop.llm.backend_torch import TorchBackend
from warploop.llm.engine import Engine, SamplingParams
from warploop.llm.kv_cache import KVCacheLayout
from warploop.llm.mk.backend import MegakernelBackend


def run_together(engine, requests) -> dict[int, list[int]]:
    """Submit every (prompt ids, SamplingParams) at once; each request's tokens, by index, once all
    have finished (an event's error fails the test)."""
    outs, done = {}, threading.Semaphore(0)

    def on_event(i):
        def cb(event):
            assert event.error is None, event.error
            if event.token_id is not None:
                outs.setdefault(i, []).append(event.token_id)
            if event.finish_reason is not None:
                done.release()
        return cb

    for i, (prompt, params) in enumerate(requests):
        engine.add_request(prompt, params, on_event(i))
    for _ in requests:
        assert done.acquire(timeout=300), "a request never finished"
    return outs


def test_tiny_model_greedy_through_the_engine_matches_torch_backend():
    """The embedded model end to end: its first decode step from the prefill's token, the next from the
    graph's own (three tokens: each step of this model costs the CPU executor seconds)."""
    params = SamplingParams(max_tokens=3, temperature=0.0)
    outs = {}
    for name in ("torch", "megakernel"):
        with Engine.from_model("tiny", device="cpu", backend=name, max_num_seqs=2, num_kv_blocks=64,
                               progress=False) as engine:
            outs[name] = engine.generate("def main(", params).token_ids
            if name == "megakernel":
                assert engine.backend.last is not None, "decode steps did not run on the graph"
    assert len(outs["torch"]) == 3 and outs["megakernel"] == outs["torch"]


def test_unknown_backend_name_is_refused_before_loading():
    with pytest.raises(ValueError, match="backend 'mega' is not one of torch, megakernel"):
        Engine.from_model("tiny", device="cpu", backend="mega")


def _engine_runs(backend: str, num_kv_blocks: int, block_size: int, max_num_seqs: int,
                 enable_prefix_caching: bool) -> tuple[list[list[int]], dict]:
    """Requests through an engine on the small random model (a step of the tiny model costs the
    CPU executor several times as much): (each request's tokens, the engine's stats)."""
    cfg, weights = LLAMA_GQA, model_weights(LLAMA_GQA)
    layout = KVCacheLayout(cfg.num_layers, num_kv_blocks, block_size, cfg.num_kv_heads, cfg.head_dim, "float32")
    context = num_kv_blocks * block_size
    model = TorchBackend(cfg, weights, layout, "cpu", context) if backend == "torch" else \
        MegakernelBackend(cfg, weights, layout, "cpu", context)
    with Engine(cfg, model, None, max_context=context, max_num_seqs=max_num_seqs,
                enable_prefix_caching=enable_prefix_caching) as engine:
        if enable_prefix_caching:
            prefix = [7, 3, 9, 12, 5, 40, 2, 8] * 4 + [30, 31]      # 34 tokens: two full blocks of 16
            params = SamplingParams(max_tokens=3, temperature=0.0)
            first = engine.generate(prefix + [100, 101], params).token_ids
            second = engine.generate(prefix + [200, 201], params).token_ids
            return [first, second], engine.stats()
        # two requests at once, longer than the pool holds together: one is preempted and resumed
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        outs = run_together(engine, [([3, 1, 4], params), ([9, 2, 6], params)])
        return [outs[0], outs[1]], engine.stats()


def test_prefix_cache_hits_read_the_cached_kv_on_the_graph():
    """A second prompt sharing a cached prefix (two full blocks) skips its prefill there; the
    megakernel's decode steps then read KV the per-op prefill wrote for another request."""
    want, _ = _engine_runs("torch", 32, 16, max_num_seqs=1, enable_prefix_caching=True)
    got, stats = _engine_runs("megakernel", 32, 16, max_num_seqs=1, enable_prefix_caching=True)
    assert stats["prefix_cache_hit_tokens"] == 32 and got == want


def test_preemption_between_graph_steps_keeps_tokens_equal():
    """Two sequences in a pool too small for both: the scheduler preempts one between decode steps
    (its blocks freed, recomputed later) and the graph's block tables change under it."""
    want, ref_stats = _engine_runs("torch", 3, 4, max_num_seqs=2, enable_prefix_caching=False)
    got, stats = _engine_runs("megakernel", 3, 4, max_num_seqs=2, enable_prefix_caching=False)
    assert stats["preemptions"] > 0 and ref_stats["preemptions"] > 0
    assert got == want and all(len(t) == 6 for t in got)


def test_engine_runs_batch_1_on_the_graph_and_larger_batches_per_op():
    """graph_rows 1 (a GPU's default) through the engine: two requests decode together per op, then
    the longer one alone on the graph; the tokens are the per-op backend's."""
    cfg, weights = LLAMA_GQA, model_weights(LLAMA_GQA)
    requests = [([3, 1, 4, 1, 5], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)),
                ([9, 2, 6], SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True))]
    outs = {}
    for name in ("torch", "megakernel"):
        layout = KVCacheLayout(cfg.num_layers, 64, 4, cfg.num_kv_heads, cfg.head_dim, "float32")
        backend = TorchBackend(cfg, weights, layout, "cpu", 128) if name == "torch" else \
            MegakernelBackend(cfg, weights, layout, "cpu", 128, graph_rows=1)
        per_op_decodes = []
        if name == "megakernel":
            per_op = backend.per_op_forward

            def spy(batch, per_op=per_op, seen=per_op_decodes):
                if batch.is_decode:
                    seen.append(batch.num_seqs)
                return per_op(batch)
            backend.per_op_forward = spy
        with Engine(cfg, backend, None, max_context=128, max_num_seqs=2) as engine:
            outs[name] = run_together(engine, requests)
            if name == "megakernel":
                assert backend.buckets == [1] and backend.last is backend.graphs[1]   # batch 1 ran on the graph
                assert per_op_decodes and set(per_op_decodes) == {2}                  # batch 2 per op, only it
    assert outs["megakernel"] == outs["torch"] and [len(outs["torch"][i]) for i in (0, 1)] == [3, 7]
