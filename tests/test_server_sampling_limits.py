"""Sampling parameters checked against what the engine represents, and one failing request isolated
from the batch it shares (in process, on the tiny model: fast)."""
from __future__ import annotations

import os
import queue

import pytest

from warploop.llm.engine import Engine
from warploop.llm.params import MIN_TOP_P, SamplingParams, SamplingParamsError

PROMPT = "def main():\n"


@pytest.fixture(scope="module")
def engine():
    device = os.environ.get("WARPLOOP_DEVICE") or "cpu"  # WARPLOOP_DEVICE=cuda runs these on a GPU
    with Engine.from_model("tiny", device=device, num_kv_blocks=64, progress=False) as engine:
        yield engine


@pytest.mark.parametrize("field,value", [
    ("top_k", 2**63), ("top_k", 2**31), ("seed", 2**64), ("seed", -(2**63) - 1),
    ("repetition_penalty", 1e-300), ("repetition_penalty", 1e300),
    ("stop", ["x"] * 17), ("stop", ["y" * 257]), ("stop_token_ids", list(range(257))),
    ("stop_token_ids", [2**63]),
])
def test_out_of_range_field_names_itself(field, value):
    with pytest.raises(SamplingParamsError, match=field) as info:
        SamplingParams(**{field: value})
    assert info.value.field == field


def test_edges_that_the_engine_represents_are_accepted():
    assert SamplingParams(top_k=2**31 - 1, seed=2**64 - 1).seed == 2**64 - 1
    assert SamplingParams(seed=-(2**63)).seed == -(2**63)
    assert SamplingParams(stop=["z" * 256] * 16).stop[0] == "z" * 256


def test_tiny_temperature_is_greedy_and_tiny_top_p_keeps_the_best_token(engine):
    greedy = engine.generate(PROMPT, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)).token_ids
    assert len(set(greedy)) > 1, "the greedy reference should not be one token repeated"
    tiny_t = SamplingParams(max_tokens=8, temperature=1e-38, ignore_eos=True)
    assert tiny_t.greedy
    assert engine.generate(PROMPT, tiny_t).token_ids == greedy
    tiny_p = SamplingParams(max_tokens=8, temperature=1.0, top_p=1e-45, seed=3, ignore_eos=True)
    assert tiny_p.top_p == MIN_TOP_P
    assert engine.generate(PROMPT, tiny_p).token_ids == greedy


@pytest.mark.parametrize("poison_at", [1, 3])  # after the prefill; mid-decode, where steps overlap
def test_a_poisoned_request_fails_alone_beside_four_good_ones(engine, caplog, poison_at):
    good = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    reference = engine.generate(PROMPT, good).token_ids
    events: queue.Queue = queue.Queue()
    poisoned = SamplingParams(max_tokens=12, temperature=0.7, seed=1, ignore_eos=True)
    seen = []

    def poison_later(event):
        # Change the params after every check ran, once the request is batched with the others:
        # the sampler's next step overflows on it, as an unchecked top_k >= 2**63 did.
        seen.append(event)
        if len(seen) == poison_at:
            poisoned.top_k = 2**63
        events.put(event)

    ids = [engine.add_request(engine.tokenizer.encode(PROMPT), good, events.put) for _ in range(4)]
    bad_id = engine.add_request(engine.tokenizer.encode(PROMPT), poisoned, poison_later)
    finals, tokens = {}, {rid: [] for rid in ids}
    while len(finals) < 5:
        event = events.get(timeout=60)
        if event.request_id in tokens and event.token_id is not None:
            tokens[event.request_id].append(event.token_id)
        if event.finish_reason:
            finals[event.request_id] = event
    assert finals[bad_id].finish_reason == "abort" and "Overflow" in finals[bad_id].error
    # the step already in flight when the poison landed still completes: at most one token more
    assert poison_at <= finals[bad_id].completion_tokens <= poison_at + 1
    for rid in ids:
        assert finals[rid].finish_reason == "length" and finals[rid].error is None
        assert tokens[rid] == reference
    assert engine.stats()["running"] == 0
    assert "a step of 5 requests failed" in caplog.text  # it did share a step with the good ones
    if poison_at > 1:
        assert "overlapped decode step failed" in caplog.text
