"""Tensor parallelism on the streaming decoder, on the CPU reference: each rank's program (its heads
and MLP columns, o_proj and down_proj partial sums added into the residual by all-reduce nodes) run
in a thread of its own, the ranks exchanging partials (reference.Exchange). Every rank holds the
same residual bits and picks the same tokens, the one-rank decoder's."""
import dataclasses
import threading

import pytest
import torch
from test_stream_step import CONFIGS, bf16_exact_weights

from warploop.llm.stream_step import StreamDecoder
from warploop.llm.tp.shard import shard_weights
from warploop.runtime.stream.hazards import check_hazards
from warploop.runtime.stream.kinds import ALLREDUCE
from warploop.runtime.stream.program import StreamProgram
from warploop.runtime.stream.reference import Exchange, ExchangeTimeout

PROMPT = [3, 17, 5, 60, 2, 41]


def run_ranks(world, fn, timeout=120):
    """fn(rank, exchange side) in one thread a rank; their results in rank order (a rank's error raised)."""
    ex = Exchange(world, timeout=60)
    out, errors = [None] * world, []

    def body(r):
        try:
            out[r] = fn(r, ex.rank(r))
        except BaseException as e:     # noqa: BLE001 (handed to the test's thread)
            errors.append(e)

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a rank never finished"
    if errors:
        raise errors[0]
    return out


def steps_of(dec):
    """The logits of every step after the prompt's first token, and a decode loop's tokens after them."""
    logits = [dec.step(tok, pos).clone() for pos, tok in enumerate(PROMPT)]
    return logits, dec.generate(int(logits[-1].argmax()), len(PROMPT), 8)


# llama3_v65: a vocabulary of 65 over two ranks: the last shard holds 32 real rows of 33, one lm_head tile
# fewer than the first (its pairs' run ends in -inf), and a padded row that must never be sampled
CASES = CONFIGS | {"llama3_v65": dataclasses.replace(CONFIGS["llama3"], vocab_size=65)}


@pytest.mark.parametrize("name, world", [("llama3", 2), ("llama3", 4), ("qwen2_bias", 2), ("qwen3_qk_norm", 2),
                                         ("llama3_v65", 2)])
def test_ranks_give_the_one_rank_decoders_logits_and_tokens(name, world):
    cfg = CASES[name]
    w = bf16_exact_weights(cfg)
    want_logits, want_tokens = steps_of(StreamDecoder(cfg, w, max_context=32, block_size=4))
    got = run_ranks(world, lambda r, ex: steps_of(StreamDecoder(cfg, shard_weights(w, cfg, world, r), max_context=32,
                                                                block_size=4, tp=ex)))
    for r in range(1, world):           # the all-reduce sums in rank order: every rank, the same bits
        assert all(torch.equal(a, b) for a, b in zip(got[0][0], got[r][0], strict=True)), r
        assert got[r][1] == got[0][1]
    for a, b in zip(got[0][0], want_logits, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4 * b.abs().max().item())
    assert got[0][1] == want_tokens


@pytest.mark.parametrize("name", ["llama3", "llama3_v65"])
def test_ranks_sample_the_one_rank_decoders_tokens(name):
    """Sampling at a temperature on two ranks: each rank's tiles race their own vocabulary shard with
    the noise of the global token ids (kinds.SAMP_WORDS' token base), so the ranks draw one rank's."""
    cfg = CASES[name]
    w = bf16_exact_weights(cfg)
    want = StreamDecoder(cfg, w, max_context=32, block_size=4).generate(3, 0, 12, sampling=(1.1, 99))
    got = run_ranks(2, lambda r, ex: StreamDecoder(cfg, shard_weights(w, cfg, 2, r), max_context=32, block_size=4,
                                                   tp=ex).generate(3, 0, 12, sampling=(1.1, 99)))
    assert got[0] == got[1] == want


def test_a_rank_program_all_reduces_twice_a_layer_in_slices_each_with_its_counter():
    cfg = CONFIGS["llama3"]
    w = shard_weights(bf16_exact_weights(cfg), cfg, 2, 1)
    dec = StreamDecoder(cfg, w, max_context=32, block_size=4, tp=Exchange(2).rank(1))
    reduces = [n for n in dec.program.nodes if n.kind is ALLREDUCE]
    # the embedding row, two a layer, the lm_head shards' amax pairs (48 vocabulary rows a rank: 2 tiles)
    assert len(reduces) == 2 * cfg.num_layers + 2
    assert {n.fields["world"] for n in reduces} == {2}
    assert [n.fields["n"] for n in reduces] == [cfg.hidden_size] * (2 * cfg.num_layers + 1) + [2 * 2 * 2]
    assert dec.cfg.num_heads == 2 and dec.cfg.num_kv_heads == 1 and dec.kv.shape[-2] == 1
    for program in dec.programs.values():           # every level's: each all-reduce ordered against its
        check_hazards(program)                      # partials' writers and the residual's readers
    p = StreamProgram()
    x, out = p.buffer("x", 2500), p.buffer("out", 2500)
    nodes = p.allreduce(x, out, 2500, world=2, rank=0)
    assert [p.nodes[i].fields["n"] for i in nodes] == [1024, 1024, 452]
    built = p.build(4, check=True)
    meets = sorted({i.fields["meet"] for i in built.instructions if i.kind is ALLREDUCE})
    assert len(meets) == 3 and all(built.counter_sizes[m] == 1 for m in meets)   # one peer signals each


def test_shards_put_back_together_are_the_model():
    cfg = CONFIGS["qwen3_qk_norm"]
    w = bf16_exact_weights(cfg)
    shards = [shard_weights(w, cfg, 2, r) for r in range(2)]
    lw, parts = w.layers[1], [s.layers[1] for s in shards]
    q, kv, f = cfg.q_size // 2, cfg.kv_size // 2, cfg.intermediate_size // 2
    split = lambda t: (t[:q], t[q:q + kv], t[q + kv:])
    for i, full in enumerate((lw.qkv[:cfg.q_size], lw.qkv[cfg.q_size:cfg.q_size + cfg.kv_size],
                              lw.qkv[cfg.q_size + cfg.kv_size:])):
        assert torch.equal(torch.cat([split(p.qkv)[i] for p in parts]), full)
    assert torch.equal(torch.cat([p.o for p in parts], 1), lw.o)
    assert torch.equal(torch.cat([p.down for p in parts], 1), lw.down)
    assert torch.equal(torch.cat([p.gate_up[:f] for p in parts]), lw.gate_up[:cfg.intermediate_size])
    assert parts[0].o_bias is lw.o_bias and parts[1].o_bias is None     # a row-parallel bias: rank 0 adds it
    v = -(-cfg.vocab_size // 2)
    assert torch.equal(torch.cat([s.lm_head for s in shards])[:cfg.vocab_size], w.lm_head)
    assert all(s.embed.shape[0] == v for s in shards) and not shards[1].lm_head[cfg.vocab_size - v:].any()


def test_bad_shards_and_devices_are_refused_by_name():
    cfg = CONFIGS["llama3"]
    w = bf16_exact_weights(cfg)
    with pytest.raises(ValueError, match="pass the rank's share"):
        StreamDecoder(cfg, w, max_context=32, block_size=4, tp=Exchange(2).rank(0))
    with pytest.raises(ValueError, match="tp: a stream_tp.GroupRank"):
        StreamDecoder(cfg, shard_weights(w, cfg, 2, 0), device="cuda", max_context=32, block_size=4,
                      tp=Exchange(2).rank(0))
    with pytest.raises(ValueError, match="rank 2 is outside"):
        shard_weights(w, cfg, 2, 2)


def test_a_rank_that_never_comes_fails_the_waiting_rank_and_every_later_call():
    ex = Exchange(2, timeout=0.3)
    with pytest.raises(ExchangeTimeout, match=r"rank 0 waited .* for ranks \[1\]"):
        ex.rank(0).gather(torch.ones(3))
    with pytest.raises(ExchangeTimeout):               # at once: the exchange has failed
        ex.rank(1).gather(torch.ones(3))


def test_an_all_reduce_without_the_exchange_is_refused():
    cfg = CONFIGS["llama3"]
    dec = StreamDecoder(cfg, shard_weights(bf16_exact_weights(cfg), cfg, 2, 0), max_context=32, block_size=4,
                        tp=Exchange(2).rank(0))
    dec.tp = None
    with pytest.raises(ValueError, match="all-reduces over 2 ranks: run it with their exchange"):
        dec.step(3, 0)


def test_ranks_of_a_biased_model_differ_in_arena_size_but_not_in_their_all_reduce_regions(monkeypatch):
    """Rank 0 alone holds the row-parallel o_proj bias, so its arena is larger (the executor's symmetric
    memory then takes the largest of the ranks', one size the rendezvous needs); the all-reduces read
    their peers at their own offsets, so those must agree, which the executor checks across the group."""
    import torch.distributed as dist

    from warploop.runtime.stream.executor import _check_tensor_parallel
    cfg = CONFIGS["qwen3_qk_norm"]              # o_bias
    w = bf16_exact_weights(cfg)
    ex = Exchange(2)
    programs = [StreamDecoder(cfg, shard_weights(w, cfg, 2, r), max_context=32, block_size=4,
                              tp=ex.rank(r)).program for r in range(2)]
    assert programs[0].floats.size > programs[1].floats.size
    layout = lambda p: [(n.fields["src"], n.fields["out"], n.fields["n"]) for n in p.nodes if n.kind is ALLREDUCE]
    assert layout(programs[0]) == layout(programs[1])

    def group_of(rank, peer_layout):
        monkeypatch.setattr(dist, "get_world_size", lambda group: 2)
        monkeypatch.setattr(dist, "get_rank", lambda group: rank)

        def gather(out, obj, group):
            out[rank], out[1 - rank] = obj, peer_layout
        monkeypatch.setattr(dist, "all_gather_object", gather)
        return object()

    _check_tensor_parallel(programs[0], group_of(0, layout(programs[1])))
    shifted = [(s + 4, o, n) for s, o, n in layout(programs[1])]
    with pytest.raises(ValueError, match="place their all-reduce regions differently"):
        _check_tensor_parallel(programs[0], group_of(0, shifted))
