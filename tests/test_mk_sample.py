"""Sampling inside the decode graph (warploop/llm/mk/sample.py) on the CPU executor: the sampling
nodes alone over synthetic logits (greedy, seeds, top-k/top-p/min-p, repetition penalty, the
empirical distribution), then through MegakernelBackend.forward_sample on a small random model."""
import math
import types

import pytest
import torch
from mk_sample_helpers import PLAN, SampleGraph

from warploop.llm.mk.layout import RowSampling
from warploop.llm.params import SamplingParams

ROWS = 256


@pytest.fixture(scope="module")
def graphs():
    from warploop.llm.mk.tasks import tasks_for
    from warploop.runtime import Runtime

    tasks = tasks_for(PLAN)
    with Runtime(device="cpu", workers=4, tasks=tasks.all) as rt:
        # 258 tokens in 17 tiles of 16; a 16-token row in one tile, ROWS rows at once
        yield SampleGraph(rt, tasks, 4, 258), SampleGraph(rt, tasks, ROWS, 16, nodes=1)


def test_greedy_is_the_first_argmax_across_tiles(graphs):
    wide, _ = graphs
    x = torch.randn(4, 258, generator=torch.Generator().manual_seed(0))
    x[1, 40] = x[1, 200] = 9.0            # a tie across two tiles: the lower index, as torch.argmax
    x[2, 17] = x[2, 18] = 9.0             # a tie inside one tile
    assert wide.draw(x, [RowSampling()] * 4) == x.argmax(-1).tolist()
    assert wide.draw(x, [RowSampling()] * 4)[1:3] == [40, 17]


def test_greedy_over_spans_and_tile_counts_wider_than_one_wide_step(graphs):
    """Greedy rows read WIDE_LANES * KC (256 here) logits a step, and the combine as many tiles a
    step: a 600-token span in one tile takes three steps (the last masked), 300 tiles take the
    combine two; ties across steps keep the lower index, as torch.argmax."""
    wide, _ = graphs
    one_tile = SampleGraph(wide.rt, wide.tasks, 3, 600, nodes=1)
    x = torch.randn(3, 600, generator=torch.Generator().manual_seed(1))
    x[0, 100] = x[0, 400] = 9.0            # across two steps
    x[1, 599] = 9.0                        # in the masked last step
    x[2, 255] = x[2, 256] = 9.0            # either side of a step's edge
    assert one_tile.draw(x, [RowSampling()] * 3) == [100, 599, 255]
    many = SampleGraph(wide.rt, wide.tasks, 2, 4800, nodes=300)
    assert many.tiles == 300
    x = torch.randn(2, 4800, generator=torch.Generator().manual_seed(2))
    x[0, 10 * 16 + 3] = x[0, 290 * 16 + 5] = 9.0     # tiles 10 and 290: the combine's two steps
    x[1, 4799] = 9.0
    assert many.draw(x, [RowSampling()] * 2) == [163, 4799]


def test_top_k_1_and_a_tiny_top_p_are_greedy(graphs):
    wide, _ = graphs
    x = torch.randn(4, 258, generator=torch.Generator().manual_seed(1))
    greedy = x.argmax(-1).tolist()
    assert wide.draw(x, [RowSampling(1.0, top_k=1, seed=s) for s in range(4)]) == greedy
    assert wide.draw(x, [RowSampling(1.5, top_p=1e-6, seed=s) for s in range(4)]) == greedy


def test_a_seed_repeats_and_different_seeds_differ(graphs):
    _, narrow = graphs
    n = 96
    x = torch.zeros(n, 16)                     # uniform: every draw is the noise's
    same = [RowSampling(1.0, seed=1234, counter=5)] * 16       # one seed in 16 rows: one token
    a = narrow.draw(x[:16], same)
    assert a == narrow.draw(x[:16], same) and len(set(a)) == 1
    spread = narrow.draw(x, [RowSampling(1.0, seed=s, counter=5) for s in range(n)])
    assert len(set(spread)) == 16            # 96 seeds over 16 equal tokens reach all of them
    later = narrow.draw(x, [RowSampling(1.0, seed=s, counter=6) for s in range(n)])
    assert sum(p != q for p, q in zip(spread, later, strict=True)) > n // 2    # the counter moves the draw


def reference_probs(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0,
                    min_p: float = 0.0) -> torch.Tensor:
    """softmax(logits / T) after top-k, top-p and min-p (warploop/llm/sampler.py's rules), renormalised."""
    p = torch.softmax(logits.double() / temperature, -1)
    order = p.argsort(descending=True)
    keep = torch.zeros_like(p, dtype=torch.bool)
    above = 0.0
    for rank, i in enumerate(order.tolist()):
        if (top_k and rank >= top_k) or above >= top_p or p[i] < min_p * p.max():
            continue
        keep[i] = True
        above += float(p[i])
    q = torch.where(keep, p, 0.0)
    return q / q.sum()


@pytest.mark.parametrize("params", [dict(temperature=0.8, top_k=6), dict(temperature=1.3, top_p=0.7),
                                    dict(temperature=1.0, min_p=0.05)], ids=["top_k", "top_p", "min_p"])
def test_empirical_frequencies_match_the_filtered_softmax(graphs, params):
    """ROWS draws, one per row, each row its own seed: no filtered-out token, and a chi-square
    statistic far below what a wrong distribution gives (a temperature 1.25x off scores 26 for top_p)."""
    _, narrow = graphs
    logits = torch.linspace(2.0, -2.0, 16)[torch.randperm(16, generator=torch.Generator().manual_seed(3))]
    want = reference_probs(logits, **params)
    drawn = narrow.draw(logits.expand(ROWS, 16), [RowSampling(seed=1000 + s, **params) for s in range(ROWS)])
    got = torch.bincount(torch.tensor(drawn), minlength=16).double() / ROWS
    assert all(0 <= t < 16 for t in drawn)
    assert (got[want == 0] == 0).all(), "a filtered-out token was drawn"
    kept = want > 0
    chi2 = float((ROWS * (got - want)[kept] ** 2 / want[kept]).sum())
    dof = int(kept.sum()) - 1
    assert chi2 < dof + 5 * math.sqrt(2 * dof), f"chi2 {chi2:.1f} ({dof} dof): {got.tolist()} vs {want.tolist()}"


def test_repetition_penalty_lowers_a_repeated_tokens_chance(graphs):
    _, narrow = graphs
    logits = torch.zeros(16)
    logits[3], logits[9] = 2.0, -1.0
    n = 128
    rows = logits.expand(n, 16)
    plain = narrow.draw(rows, [RowSampling(1.0, seed=s) for s in range(n)])
    penalised = narrow.draw(rows, [RowSampling(1.0, repetition_penalty=3.0, seed=s) for s in range(n)],
                            history=[(3, 9)] * n)
    assert penalised.count(3) < plain.count(3) / 2
    assert penalised.count(9) <= plain.count(9)       # negative logits are multiplied: less likely still
    # greedy after the penalty, as the host sampler: a positive logit divided stays above the zeros ...
    assert narrow.draw(rows[:1], [RowSampling(0.0, repetition_penalty=30.0)], history=[(3,)]) == [3]
    logits2 = logits.clone()
    logits2[5] = 1.9
    # ... but falls below a close second (2.0 / 1.5 < 1.9)
    assert narrow.draw(logits2[None], [RowSampling(0.0, repetition_penalty=1.5)], history=[(3,)]) == [5]


def test_filters_that_reach_past_the_candidates_are_left_to_the_host(graphs):
    wide, _ = graphs
    x = torch.randn(4, 258, generator=torch.Generator().manual_seed(4)) * 0.1     # flat: mass spread wide
    rows = [RowSampling(1.0, top_p=0.99, seed=0), RowSampling(1.0, top_k=100, seed=0),
            RowSampling(1.0, min_p=0.999, seed=0), RowSampling(1.0, top_k=PLAN.candidates, seed=0)]
    got = wide.draw(x, rows)
    assert got[:2] == [-1, -1]
    assert got[2] == int(x[2].argmax())             # min_p near 1 keeps only the top token: inside
    assert 0 <= got[3] < 258


def fake_seq(tokens, prompt_len, **params):
    """A sequence as the backend sees it: its tokens so far, the first `prompt_len` of them its prompt."""
    return types.SimpleNamespace(params=SamplingParams(**params), token_ids=list(tokens), generator=None,
                                 num_prompt_tokens=prompt_len)


@pytest.fixture(scope="module")
def model():
    from mk_helpers import LLAMA_GQA, backends, model_weights

    ref, mk = backends(LLAMA_GQA, model_weights(LLAMA_GQA), max_num_seqs=4)
    yield ref, mk
    mk.close()


def decode_batch(prompts):
    from warploop.llm.backend import ModelBatch

    tables = [list(range(i * 8, i * 8 + 8)) for i in range(len(prompts))]
    lens = [len(p) for p in prompts]
    prefill = ModelBatch([t for p in prompts for t in p], [i for p in prompts for i in range(len(p))], lens[:],
                         lens[:], tables)
    nxt = [p[-1] for p in prompts]
    return prefill, ModelBatch(nxt, lens[:], [1] * len(prompts), [n + 1 for n in lens], tables)


def test_backend_samples_in_the_graph_greedy_seeded_and_falls_back(model):
    ref, mk = model
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6], [5, 3, 5, 8, 9, 7]]
    prefill, step = decode_batch(prompts)
    ref.forward(prefill)
    mk.forward(prefill)
    want = ref.forward(step).argmax(-1).tolist()
    seqs = [fake_seq(p + [p[-1]], len(p), temperature=0.0) for p in prompts]
    assert mk.forward_sample(step, seqs).tolist() == want        # greedy: the per-op backend's argmax
    seeded = [fake_seq(p + [p[-1]], len(p), temperature=1.0, seed=7) for p in prompts]
    first = mk.forward_sample(step, seeded).tolist()             # the same step again: same KV, same draw
    assert mk.forward_sample(step, seeded).tolist() == first
    # launched ahead (engine overlap), a sequence has not got its newest token on the host yet: the
    # draw keys on the batch's context length, so it is the same
    behind = [fake_seq(p, len(p), temperature=1.0, seed=7) for p in prompts]
    assert mk.forward_sample(step, behind).tolist() == first
    others = [fake_seq(p + [p[-1]], len(p), temperature=1.0, seed=8 + i) for i, p in enumerate(prompts)]
    assert mk.forward_sample(step, others).tolist() != first
    flat = [fake_seq(p + [p[-1]], len(p), temperature=50.0, top_p=0.999, seed=1) for p in prompts]
    tokens = mk.forward_sample(step, flat)
    assert mk.last.buffers.tokens[:3].tolist() == [-1, -1, -1]    # drawn on the host instead
    assert tokens.dtype == torch.int64 and all(0 <= t < ref.config.vocab_size for t in tokens.tolist())
    assert not math.isnan(float(tokens.sum()))


def test_seeded_sampling_through_the_engine_repeats():
    """A seeded request drawn on the graph, through the engine, gives the same tokens again (the small
    random model: a step of the tiny model costs the CPU executor several times as much)."""
    from mk_helpers import LLAMA_GQA, model_weights

    from warploop.llm.engine import Engine
    from warploop.llm.kv_cache import KVCacheLayout
    from warploop.llm.mk.backend import MegakernelBackend

    cfg = LLAMA_GQA
    layout = KVCacheLayout(cfg.num_layers, 16, 4, cfg.num_kv_heads, cfg.head_dim, "float32")
    backend = MegakernelBackend(cfg, model_weights(cfg), layout, "cpu", 64)
    params = SamplingParams(max_tokens=3, temperature=0.9, top_k=20, seed=11, ignore_eos=True)
    with Engine(cfg, backend, None, max_context=64, max_num_seqs=1) as engine:
        first = engine.generate([3, 1, 4], params).token_ids
        assert engine.backend.last is not None, "decode steps did not run on the graph"
        assert int(engine.backend.last.buffers.tokens[0]) == first[-1]      # the graph drew the last token
        assert engine.generate([3, 1, 4], params).token_ids == first
        # a prompt of a block and one token: the second time its block is cached and its prefill is one
        # token, a decode row's shape; its first token is still the host sampler's, so it repeats
        once = engine.generate([3, 1, 4, 1, 5], params).token_ids
        hits = engine.stats()["prefix_cache_hit_tokens"]
        assert engine.generate([3, 1, 4, 1, 5], params).token_ids == once
        assert engine.stats()["prefix_cache_hit_tokens"] - hits == 4
