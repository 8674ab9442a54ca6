"""The streaming executor as the engine's backend (`--backend stream`), on the CPU reference: the
tiny model in bfloat16 gives the per-op backend's greedy tokens with batch-1 decode loops on the
device, a budget and a stop id cut a loop where the per-op path stops, prefix hits and preemption
keep the tokens, sampled requests take single steps, and what it cannot run is refused by name."""
import pytest
from test_mk_engine import run_together

from warploop.llm.engine import Engine, SamplingParams

TINY = dict(device="cpu", dtype="bfloat16", progress=False)


def _run(backend, requests, **options):
    """Each request's tokens and the engine's stats, the requests submitted together."""
    with Engine.from_model("tiny", backend=backend, **(TINY | options)) as engine:
        outs = run_together(engine, [(engine.tokenizer.encode(p), params) for p, params in requests])
        return [outs[i] for i in range(len(requests))], engine.stats()


def test_tiny_model_greedy_decode_loops_give_the_per_op_tokens():
    requests = [("def main(", SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))]
    want, _ = _run("torch", requests, max_num_seqs=1, num_kv_blocks=64)
    got, stats = _run("stream", requests, max_num_seqs=1, num_kv_blocks=64)
    assert got == want and len(got[0]) == 40
    # 39 decode tokens in loops of at most 32 steps; every lent block taken or given back
    assert stats["decode_loops"] >= 2 and stats["decode_loop_tokens"] == 39
    assert stats["kv_blocks_used"] == 0


@pytest.mark.parametrize("stop, launched_at", [([], [1, 1]), (["never"], [1, 33])])
def test_the_next_loop_launches_before_the_last_ones_tokens_are_streamed(monkeypatch, stop, launched_at):
    """40 tokens: the prefill's, then loops of 32 and 7 steps. The second loop launches before the
    first one's 32 tokens are detokenized and streamed (the device decodes while the host does
    that), unless a stop string could end the request inside them (only the text shows it)."""
    from warploop.llm import engine as engine_mod
    from warploop.llm import stream_backend
    streamed, launched = [], []
    emit, start = engine_mod.Engine._emit, stream_backend.StreamBackend.start_loop
    monkeypatch.setattr(engine_mod.Engine, "_emit", lambda self, req, token: (streamed.append(token),
                                                                              emit(self, req, token))[1])
    monkeypatch.setattr(stream_backend.StreamBackend, "start_loop",
                        lambda self, *a, **k: (launched.append(len(streamed)), start(self, *a, **k))[1])
    requests = [("def main(", SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop=stop))]
    got, stats = _run("stream", requests, max_num_seqs=1, num_kv_blocks=64)
    want, _ = _run("torch", requests, max_num_seqs=1, num_kv_blocks=64)
    assert launched == launched_at and streamed[:40] == got[0] == want[0]
    assert stats["decode_loop_tokens"] == 39 and stats["kv_blocks_used"] == 0


def test_a_budget_and_a_stop_id_end_a_loop_where_single_steps_would():
    plain = [("def main(", SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))]
    tokens = _run("torch", plain, max_num_seqs=1, num_kv_blocks=64)[0][0]
    stop = tokens[7]
    requests = [("def main(", SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)),
                ("def main(", SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True,
                                             stop_token_ids=[stop]))]
    for params in requests:
        want, _ = _run("torch", [params], max_num_seqs=1, num_kv_blocks=64)
        got, stats = _run("stream", [params], max_num_seqs=1, num_kv_blocks=64)
        assert got == want and stats["decode_loops"] >= 1 and stats["kv_blocks_used"] == 0
    assert len(want[0]) == tokens.index(stop) + 1


def test_prefix_hits_and_preemption_keep_the_tokens():
    prefix = "import os\nimport sys\nimport json\n" * 3          # two full blocks of 16
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    for requests, options in (([(prefix + "def a(", greedy)], dict(max_num_seqs=1, num_kv_blocks=32)),
                              ([("def main(", greedy), ("class A:\n", greedy)],
                               dict(max_num_seqs=2, num_kv_blocks=3, block_size=8, enable_prefix_caching=False))):
        want, _ = _run("torch", requests, **options)
        got, stats = _run("stream", requests, **options)
        assert got == want and stats["kv_blocks_used"] == 0
    assert stats["preemptions"] > 0


def test_temperature_requests_loop_on_the_stream_and_filtered_ones_take_single_steps():
    """A request sampled at a temperature alone is drawn on the device (Gumbel-max), in decode loops;
    one with top-p takes single steps, sampled on the host (test_stream_device_sampling.py checks the
    draws)."""
    requests = [("def main(", SamplingParams(max_tokens=6, temperature=0.8, seed=3, ignore_eos=True))]
    got, stats = _run("stream", requests, max_num_seqs=1, num_kv_blocks=64)
    assert len(got[0]) == 6 and stats["decode_loops"] >= 1
    requests = [("def main(", SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9, seed=3, ignore_eos=True))]
    got, stats = _run("stream", requests, max_num_seqs=1, num_kv_blocks=64)
    assert len(got[0]) == 6 and stats["decode_loops"] == 0


def test_what_the_stream_backend_cannot_run_is_refused_by_name():
    with pytest.raises(ValueError, match="--dtype bfloat16"):
        Engine.from_model("tiny", device="cpu", backend="stream", dtype="float32", progress=False)
    with pytest.raises(ValueError, match="is not one of torch, megakernel, stream"):
        Engine.from_model("tiny", device="cpu", backend="streaming")


def test_unsupported_names_why_a_model_falls_back_from_the_stream_default():
    """On Hopper the default is the streaming backend only for models it runs (build_backend falls
    back to the megakernel): bfloat16, no MLP bias, a power-of-two head_dim from 16 to 256."""
    import dataclasses

    import torch

    from warploop.llm.config import ModelConfig
    from warploop.llm.stream_step import unsupported
    cfg = ModelConfig(family="llama", vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=16)
    assert unsupported(cfg, torch.bfloat16) is None and unsupported(cfg, "bfloat16") is None
    assert "float16" in unsupported(cfg, torch.float16)
    assert "MLP bias" in unsupported(dataclasses.replace(cfg, mlp_bias=True), "bfloat16")
    assert "head_dim" in unsupported(dataclasses.replace(cfg, head_dim=96, hidden_size=384), "bfloat16")


def test_the_per_op_path_reads_the_stream_pools_one_copy_of_the_model():
    """build_backend packs the weight pools before the KV cache, and every matrix of the per-op
    path (and a tied embedding) becomes a view of a pool: the model is held once."""
    with Engine.from_model("tiny", backend="stream", **TINY) as engine:
        backend = engine.backend
        pools = backend.decoder.program.pools
        w = backend.per_op.w
        spans = [(p.data_ptr(), p.data_ptr() + p.numel() * p.element_size()) for p in pools]
        inside = lambda t: any(lo <= t.data_ptr() < hi for lo, hi in spans)
        mats = [getattr(lw, n) for lw in w.layers for n in ("qkv", "o", "gate_up", "down")] + [w.lm_head]
        assert all(inside(m) for m in mats)
        if engine.config.tie_word_embeddings:
            assert w.embed is w.lm_head
        out = engine.generate("def main(", SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
        assert len(out.token_ids) == 8


def test_pack_pools_shares_only_bfloat16_weights_on_the_device_and_counts_the_rest():
    import torch
    from test_stream_step import CONFIGS

    from warploop.llm.stream_pools import pack_pools
    from warploop.llm.weights import random_weights
    cfg = CONFIGS["llama3"]
    w32 = random_weights(cfg, "cpu", torch.float32)
    packed = pack_pools(w32, "cpu", share=True)
    assert packed.copied_bytes == sum(p.numel() * 2 for p in packed.pools.values())
    assert w32.layers[0].qkv.dtype == torch.float32                  # left as it was
    w16 = random_weights(cfg, "cpu", torch.bfloat16)
    qkv = w16.layers[0].qkv.clone()
    packed = pack_pools(w16, "cpu", share=True)
    assert packed.copied_bytes == 0 and torch.equal(w16.layers[0].qkv, qkv)
    pool = packed.pools[cfg.hidden_size]
    assert w16.layers[0].qkv.data_ptr() == pool.data_ptr()           # the first matrix of its width


@pytest.fixture
def stream_rows(monkeypatch):
    """WARPLOOP_STREAM_ROWS=8: decode batches of 2 to 8 sequences on the stream's batched program."""
    from warploop import config
    monkeypatch.setenv("WARPLOOP_STREAM_ROWS", "8")
    config.reload()
    yield 8
    monkeypatch.delenv("WARPLOOP_STREAM_ROWS")
    config.reload()


def test_batches_run_decode_loops_on_the_stream_and_give_each_rows_own_tokens(stream_rows, monkeypatch):
    """Six greedy requests together, budgets and a stop id of their own: decode loops of the batch
    on the batched program (every launch as long as its smallest budget), each request's tokens as
    it makes them alone (batch 1 on the stream; its fp32 activations part from the per-op backend's
    bf16 ones at near ties on some of these prompts), every lent block taken or given back."""
    from warploop.llm.stream_step import StreamDecoder
    launches = []
    launch = StreamDecoder.launch_rows
    monkeypatch.setattr(StreamDecoder, "launch_rows", lambda self, tokens, *a, **kw: (
        launches.append((self.batch, len(tokens))), launch(self, tokens, *a, **kw)))
    plain = [("def main(", SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))]
    tokens = _run("torch", plain, max_num_seqs=1, num_kv_blocks=64)[0][0]
    # budgets up to 18 tokens: two rows' loops cross into a second block of 16
    budgets = (3, 9, 18, 15, 6)
    requests = [(p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
                for p, n in zip(("def main(", "class A:\n", "import os", "x = [", "# note"), budgets, strict=True)]
    requests.append(("def main(", SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True,
                                                 stop_token_ids=[tokens[4]])))
    alone = _run("stream", requests, max_num_seqs=1, num_kv_blocks=128)[0]      # one at a time: batch 1
    launches.clear()
    got, stats = _run("stream", requests, max_num_seqs=8, num_kv_blocks=128)
    assert got == alone and [len(t) for t in got] == [*budgets, 5]
    assert got[0] == tokens[:3] and got[-1] == tokens[:5]        # the per-op backend's, on this prompt
    assert stats["decode_loops"] >= 3 and stats["kv_blocks_used"] == 0
    assert any(rows == 8 and live >= 2 for rows, live in launches)       # batches ran on the 8-row program


def test_sampled_batches_take_single_steps_on_the_batched_stream(stream_rows, monkeypatch):
    from warploop.llm.stream_step import StreamDecoder
    steps = []
    step_rows = StreamDecoder.step_rows
    monkeypatch.setattr(StreamDecoder, "step_rows", lambda self, tokens, *a: (steps.append(len(tokens)),
                                                                              step_rows(self, tokens, *a))[1])
    requests = [(p, SamplingParams(max_tokens=6, temperature=0.8, seed=3, ignore_eos=True))
                for p in ("def main(", "class A:\n", "import os")]
    got, stats = _run("stream", requests, max_num_seqs=4, num_kv_blocks=64)
    assert [len(t) for t in got] == [6, 6, 6] and stats["decode_loops"] == 0
    assert 3 in steps                                              # a step of all three rows


@pytest.mark.parametrize("value, match", [("1", "2 to 32"), ("33", "2 to 32"), ("eight", "whole number")])
def test_stream_rows_setting_is_checked_by_name(monkeypatch, value, match):
    from warploop import config
    monkeypatch.setenv("WARPLOOP_STREAM_ROWS", value)
    try:
        with pytest.raises(ValueError, match=f"WARPLOOP_STREAM_ROWS.*{match}"):
            config.reload()
    finally:
        monkeypatch.delenv("WARPLOOP_STREAM_ROWS")
        config.reload()


def test_an_engine_with_nothing_deferred_is_settled_at_once():
    with Engine.from_model("tiny", backend="torch", **TINY) as engine:
        assert engine.settle(10)


def test_deferred_work_waits_for_a_quiet_engine(monkeypatch):
    """Backend.idle runs only once the engine has had nothing to do for DEFERRED_QUIET_S: a request that
    comes at once after the start, or soon after another, never queues behind a piece of it."""
    import time

    from warploop.llm import engine_loop
    from warploop.llm.backend_torch import TorchBackend

    monkeypatch.setattr(engine_loop, "DEFERRED_QUIET_S", 0.4)
    pieces = []
    monkeypatch.setattr(TorchBackend, "idle", lambda self: (pieces.append(time.monotonic()), len(pieces) < 3)[1])
    with Engine.from_model("tiny", backend="torch", **TINY) as engine:
        params = SamplingParams(max_tokens=4, temperature=0.0)
        for _ in range(3):          # at once, then back to back: never 0.4 s quiet
            engine.generate([1, 2, 3], params)
        done = time.monotonic()
        assert engine.stats()["deferred_pending"] == 1          # what /metrics reports (serve_load waits on it)
        assert engine.settle(30) and len(pieces) == 3
        assert engine.stats()["deferred_pending"] == 0
        assert pieces[0] - done >= 0.35, pieces[0] - done


def test_the_engine_builds_the_deferred_split_levels_while_idle():
    """The stream backend starts with the largest and smallest split level's programs; the engine's
    loop builds the others while no request waits (Backend.idle), and a request that came first
    is served meanwhile with the per-op backend's tokens; Engine.settle waits for the rest."""
    requests = [("def main(", SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))]
    want, _ = _run("torch", requests, max_num_seqs=1)
    with Engine.from_model("tiny", backend="stream", **(TINY | dict(max_num_seqs=1))) as engine:
        dec = engine.backend.decoder
        assert len(dec.levels) >= 3, dec.levels          # levels to defer
        got = engine.generate(engine.tokenizer.encode(requests[0][0]), requests[0][1])
        assert engine.settle(60)
        assert dec._deferred == [] and sorted(dec.programs) == dec.levels
        assert got.token_ids == want[0] and len(want[0]) == 12
