"""The engine on the CPU: prefix caching, paged KV across block sizes, preemption, stops, streaming, abort."""
from __future__ import annotations

import threading

import pytest
from llm_helpers import BOS, EOS, engine_for, make_model_dir

from warploop.llm.params import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path, _ = make_model_dir(tmp_path_factory.mktemp("engine"), "qwen2", initializer_range=0.3)
    return path


def prompts(n: int, length: int = 10) -> list[list[int]]:
    return [[BOS] + [(i * 7 + j * 13) % 256 for j in range(length + 3 * i)] for i in range(n)]


def run_all(engine, batch: list[list[int]], params: SamplingParams | list = GREEDY) -> list[list[int]]:
    """Submit every prompt at once (they share steps) and wait for all of them."""
    params = params if isinstance(params, list) else [params] * len(batch)
    done = threading.Semaphore(0)
    outs: list[list[int]] = [[] for _ in batch]

    def collect(i):
        def on_event(event):
            if event.token_id is not None:
                outs[i].append(event.token_id)
            if event.finish_reason is not None:
                done.release()
        return on_event

    for i, p in enumerate(batch):
        engine.add_request(p, params[i], collect(i))
    for _ in batch:
        assert done.acquire(timeout=60)
    return outs


def test_prefix_cache_computes_only_new_tokens(model_dir):
    shared = prompts(1, 30)[0]  # 31 tokens: 7 full blocks of 4
    first, second = shared + [1, 2, 3], shared + [9, 8, 7, 6, 5]
    with engine_for(model_dir, block_size=4, enable_prefix_caching=False) as plain:
        want = plain.generate(second, GREEDY).token_ids
    with engine_for(model_dir, block_size=4) as engine:
        engine.generate(first, GREEDY)
        before = engine.stats()
        got = engine.generate(second, GREEDY).token_ids
        after = engine.stats()
    hit = after["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"]
    assert hit == 28
    assert after["prefill_tokens_computed"] - before["prefill_tokens_computed"] == len(second) - 28
    assert got == want


def test_identical_prompt_recomputes_only_its_last_block(model_dir):
    prompt = prompts(1, 15)[0]  # 16 tokens = 4 full blocks; the last must run to give logits
    with engine_for(model_dir, block_size=4) as engine:
        a = engine.generate(prompt, GREEDY).token_ids
        before = engine.stats()["prefill_tokens_computed"]
        b = engine.generate(prompt, GREEDY).token_ids
        assert engine.stats()["prefill_tokens_computed"] - before == 4
    assert a == b


@pytest.mark.parametrize("caching", [True, False])
def test_outputs_identical_across_block_sizes(model_dir, caching):
    batch = prompts(5)
    results = []
    for block_size in (1, 4, 16):
        with engine_for(model_dir, block_size=block_size, num_kv_blocks=1024 // block_size,
                        enable_prefix_caching=caching) as engine:
            results.append(run_all(engine, batch))
            assert engine.stats()["overlapped_steps"] > 0
    assert results[0] == results[1] == results[2]
    assert all(len(r) == GREEDY.max_tokens for r in results[0])


def test_preemption_under_tiny_pool_keeps_greedy_outputs(model_dir):
    batch = prompts(4)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    with engine_for(model_dir, block_size=4) as roomy:
        want = run_all(roomy, batch, params)
        assert roomy.stats()["preemptions"] == 0
    for caching in (True, False):
        with engine_for(model_dir, block_size=4, num_kv_blocks=20, enable_prefix_caching=caching) as tight:
            got = run_all(tight, batch, params)
            assert tight.stats()["preemptions"] > 0
            assert tight.stats()["kv_blocks_used"] == 0
        assert got == want


def test_token_budget_and_seq_limit_still_finish_everything(model_dir):
    batch = prompts(6)
    with engine_for(model_dir) as roomy:
        want = run_all(roomy, batch)
    with engine_for(model_dir, max_num_seqs=2, max_batch_tokens=16) as narrow:
        assert run_all(narrow, batch) == want


def test_stop_strings_truncate_text_and_stream(model_dir):
    prompt = prompts(1)[0]
    long = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    with engine_for(model_dir) as engine:
        full = engine.generate(prompt, long)
        assert full.text == engine.tokenizer.decode(full.token_ids)
        stop = next(full.text[i:i + 2] for i in range(4, len(full.text)) if "\ufffd" not in full.text[i:i + 2])
        cut = full.text[:full.text.find(stop)]
        params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=["\x00never", stop])
        events = list(engine.stream(prompt, params))
    assert "".join(e.text_delta for e in events) == cut
    assert events[-1].finish_reason == "stop"
    assert [e.completion_tokens for e in events] == list(range(1, len(events) + 1))
    assert all(e.finish_reason is None for e in events[:-1])


def test_stop_token_ids_and_eos(model_dir):
    prompt = prompts(1)[0]
    with engine_for(model_dir) as engine:
        ids = engine.generate(prompt, GREEDY).token_ids
        out = engine.generate(prompt, SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[ids[3]]))
        assert out.finish_reason == "stop" and out.token_ids == ids[:ids.index(ids[3]) + 1]
        assert EOS in engine.eos_token_ids
        engine.eos_token_ids.add(ids[2])  # as if the model had emitted its end-of-sequence token
        stopped = engine.generate(prompt, SamplingParams(max_tokens=12, temperature=0))
        assert stopped.finish_reason == "stop" and stopped.token_ids[-1] == ids[2]
        ignored = engine.generate(prompt, GREEDY)
        assert ignored.finish_reason == "length" and ignored.token_ids == ids


def test_abort_frees_blocks(model_dir):
    first = threading.Event()
    finals = []
    with engine_for(model_dir, block_size=4) as engine:
        def on_event(event):
            first.set()
            if event.finish_reason:
                finals.append(event)
        rid = engine.add_request(prompts(1)[0], SamplingParams(max_tokens=400, temperature=0, ignore_eos=True),
                                 on_event)
        assert first.wait(30)
        engine.abort(rid)
        engine.abort(rid)  # idempotent
        engine.generate([BOS, 1], GREEDY)  # a later request runs after the abort was handled
        stats = engine.stats()
    assert [e.finish_reason for e in finals] == ["abort"]
    assert stats["kv_blocks_used"] == 0 and stats["running"] == 0 and stats["waiting"] == 0


def test_rejects_bad_requests(model_dir):
    with engine_for(model_dir, num_kv_blocks=8, block_size=4) as engine:
        assert engine.max_context == 32
        with pytest.raises(ValueError, match="context of 32"):
            engine.add_request([BOS] * 30, SamplingParams(max_tokens=5), print)
        with pytest.raises(ValueError, match="prompt token ids"):
            engine.add_request([BOS, 999], SamplingParams(), print)
        with pytest.raises(ValueError, match="empty"):
            engine.add_request([], SamplingParams(), print)
    for field, value in (("temperature", -1.0), ("top_p", 0.0), ("top_k", -3), ("min_p", 2.0),
                         ("max_tokens", 0), ("repetition_penalty", 0.0), ("stop", [""])):
        with pytest.raises(ValueError, match=field):
            SamplingParams(**{field: value})


def test_stream_and_stats_under_concurrency(model_dir):
    with engine_for(model_dir) as engine:
        outs = run_all(engine, prompts(8), SamplingParams(max_tokens=5, temperature=0.8, seed=1))
        stats = engine.stats()
    assert all(len(o) == 5 for o in outs)
    assert stats["generation_tokens_total"] == 40
    assert stats["prompt_tokens_total"] == sum(len(p) for p in prompts(8))


def test_overlapped_decode_matches_one_request_at_a_time(model_dir):
    """Requests that end at different steps (max_tokens, stop ids) while the next step is already
    in flight: each gets exactly what it gets alone, and the pool is clean afterwards."""
    batch = prompts(6)
    with engine_for(model_dir, block_size=4) as engine:
        alone = [engine.generate(p, GREEDY).token_ids for p in batch]
        params = [SamplingParams(max_tokens=3 + 2 * i, temperature=0, ignore_eos=True) for i in range(5)]
        params.append(SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[alone[5][4]]))
        before = engine.stats()["overlapped_steps"]
        together = run_all(engine, batch, params)
        assert engine.stats()["overlapped_steps"] > before
        assert engine.stats()["kv_blocks_used"] == 0
    for i in range(5):
        assert together[i] == alone[i][:3 + 2 * i]
    assert together[5] == alone[5][:alone[5].index(alone[5][4]) + 1]


def test_a_failing_step_fails_its_requests_and_the_engine_goes_on(model_dir, monkeypatch):
    with engine_for(model_dir) as engine:
        real = engine.backend.forward
        monkeypatch.setattr(engine.backend, "forward", lambda batch: 1 / 0)
        out = engine.generate(prompts(1)[0], GREEDY)
        assert out.finish_reason == "abort" and "ZeroDivisionError" in out.error
        monkeypatch.setattr(engine.backend, "forward", real)
        assert engine.generate(prompts(1)[0], GREEDY).finish_reason == "length"
        assert engine.stats()["kv_blocks_used"] == 0
