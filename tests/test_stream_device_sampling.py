"""Sampling at a temperature on the streaming decoder (the CPU reference; the kernel draws the same
numbers: runtime/stream/sampling.py, emulated in test_stream_emulated.py): a seeded draw repeats, a
loop draws what single steps draw, the race picks from softmax(logits / T), and through the engine a
temperature-only request decodes in loops on the device and repeats with its seed."""
import numpy as np
import pytest
import torch
from test_stream_step import CONFIGS, bf16_exact_weights

from warploop.llm.engine import Engine, SamplingParams
from warploop.llm.stream_step import StreamDecoder
from warploop.runtime.stream import philox


def decoder():
    cfg = CONFIGS["llama3"]
    return StreamDecoder(cfg, bf16_exact_weights(cfg), max_context=32, block_size=4)


def test_a_sampled_step_picks_the_race_winner_of_its_logits_and_repeats_with_its_seed():
    dec = decoder()
    picks = set()
    for seed in range(12):
        logits = dec.step(7, 0, sampling=(0.9, seed)).clone()
        token = dec.tokens(1)[0]
        race = logits.numpy() / np.float32(0.9) + philox.gumbel(seed, 1, np.arange(logits.numel()))
        assert token == int(np.argmax(race))
        dec.step(7, 0, sampling=(0.9, seed))
        assert dec.tokens(1)[0] == token            # the same seed and position: the same token
        picks.add(token)
    assert len(picks) > 3                           # the seeds draw different tokens
    dec.step(7, 0)
    assert dec.tokens(1)[0] == int(dec.view("logits").argmax())     # no sampling: the argmax again


def test_a_sampled_loop_draws_what_single_steps_draw():
    dec = decoder()
    looped = dec.generate(5, 3, 10, sampling=(1.3, 2 ** 64 - 3))
    stepped, token = [], 5
    for pos in range(3, 13):
        dec.step(token, pos, sampling=(1.3, 2 ** 64 - 3))
        token = dec.tokens(1)[0]
        stepped.append(token)
    assert looped == stepped


def test_bad_sampling_is_refused():
    dec = decoder()
    with pytest.raises(ValueError, match="temperature must be finite and >= 0"):
        dec.step(1, 0, sampling=(-1.0, 3))


def test_the_engine_decodes_temperature_requests_in_loops_and_repeats_them():
    params = SamplingParams(max_tokens=8, temperature=0.8, seed=11, ignore_eos=True)
    outs = []
    for loops in (True, False, True):
        with Engine.from_model("tiny", device="cpu", dtype="bfloat16", backend="stream", num_kv_blocks=32,
                               progress=False, decode_loop=loops) as engine:
            outs.append(engine.generate("def add(a, b):", params).token_ids)
            stats = engine.stats()
        assert (stats["decode_loops"] > 0) == loops
    assert outs[0] == outs[1] == outs[2] and len(outs[0]) == 8
    with Engine.from_model("tiny", device="cpu", dtype="bfloat16", backend="stream", num_kv_blocks=32,
                           progress=False) as engine:
        other = engine.generate("def add(a, b):", SamplingParams(max_tokens=8, temperature=0.8, seed=12,
                                                                  ignore_eos=True)).token_ids
        top_k = engine.generate("def add(a, b):", SamplingParams(max_tokens=8, temperature=0.8, top_k=5, seed=11,
                                                                  ignore_eos=True))
        assert engine.stats()["decode_loops"] == 1 and len(top_k.token_ids) == 8   # top-k: host steps
        # a block and one token: the second time only the last prompt token is prefilled, a decode row's
        # shape, and its first token is still the host sampler's (backend.first_token_rows): it repeats
        prompt = list(range(5, 5 + engine.blocks.block_size + 1))
        once = engine.generate(prompt, params).token_ids
        hits = engine.stats()["prefix_cache_hit_tokens"]
        assert engine.generate(prompt, params).token_ids == once
        assert engine.stats()["prefix_cache_hit_tokens"] - hits == engine.blocks.block_size
    assert other != outs[0]
    assert torch.tensor(outs[0]).unique().numel() > 3
