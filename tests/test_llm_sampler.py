"""Each sampling option does what it says (on CPU tensors; the same code runs on the GPU)."""
from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from llm_helpers import engine_for, make_model_dir

from warploop.llm.params import SamplingParams
from warploop.llm.sampler import SampleRow, make_generator, sample

PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05])
LOGITS = PROBS.log()


class Seq:
    def __init__(self, params: SamplingParams, token_ids=(), generator=None) -> None:
        self.params, self.token_ids = params, list(token_ids)
        self.generator = generator if generator is not None or params.seed is None else \
            make_generator(params.seed, "cpu")


def draws(params: SamplingParams, n: int = 4000, logits: torch.Tensor = LOGITS) -> Counter:
    """n draws as one batch of n identical rows."""
    return Counter(sample(logits.expand(n, -1).clone(), [Seq(params) for _ in range(n)]))


def test_greedy_is_argmax_per_row():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(1))
    assert sample(logits, [Seq(SamplingParams(temperature=0)) for _ in range(6)]) == logits.argmax(-1).tolist()


def test_temperature_one_follows_the_softmax():
    counts = draws(SamplingParams(temperature=1.0), n=20000)
    for token, p in enumerate(PROBS.tolist()):
        assert abs(counts[token] / 20000 - p) < 0.02


def test_low_temperature_sharpens_high_temperature_flattens():
    assert draws(SamplingParams(temperature=0.05))[0] == 4000
    flat = draws(SamplingParams(temperature=100.0))
    assert min(flat[t] for t in range(4)) > 800  # near uniform: 1000 each


def test_top_k_one_is_greedy_and_top_k_limits_choices():
    logits = torch.randn(8, 100, generator=torch.Generator().manual_seed(2))
    seqs = [Seq(SamplingParams(temperature=1.5, top_k=1)) for _ in range(8)]
    assert sample(logits, seqs) == logits.argmax(-1).tolist()
    assert set(draws(SamplingParams(top_k=2))) == {0, 1}


def test_top_p_keeps_the_smallest_set_reaching_p():
    assert set(draws(SamplingParams(top_p=0.7))) == {0, 1}   # 0.5 < 0.7, 0.5 + 0.3 >= 0.7
    assert set(draws(SamplingParams(top_p=0.45))) == {0}
    assert set(draws(SamplingParams(top_p=0.81))) == {0, 1, 2}


def test_min_p_drops_tokens_below_a_fraction_of_the_best():
    assert set(draws(SamplingParams(min_p=0.5))) == {0, 1}    # keeps p >= 0.25
    assert set(draws(SamplingParams(min_p=0.2))) == {0, 1, 2}  # keeps p >= 0.1


def test_repetition_penalty_pushes_seen_tokens_down():
    logits = torch.tensor([[3.0, 2.9, -1.0, -1.1]])
    plain = SamplingParams(temperature=0)
    penalised = SamplingParams(temperature=0, repetition_penalty=1.2)
    assert sample(logits, [Seq(plain, [0])]) == [0]
    assert sample(logits, [Seq(penalised, [0])]) == [1]        # 3.0 / 1.2 < 2.9
    assert sample(torch.tensor([[-1.0, -1.1]]), [Seq(penalised, [0])]) == [1]  # negatives are multiplied
    assert sample(logits, [Seq(penalised, [3])]) == [0]        # unseen tokens are untouched


def test_a_sample_row_is_its_sequence_with_parameters_replaced():
    logits = torch.tensor([[3.0, 2.9, -1.0, -1.1]])
    seq = Seq(SamplingParams(temperature=0, repetition_penalty=1.2, seed=5), [0])
    row = SampleRow.of(seq, repetition_penalty=1.0)
    assert row.token_ids is seq.token_ids and row.generator is seq.generator
    assert row.params == SamplingParams(temperature=0, repetition_penalty=1.0, seed=5)
    assert sample(logits, [seq]) == [1] and sample(logits, [row]) == [0]     # the penalty is the only change


def test_seed_reproduces_independently_of_the_batch():
    logits = torch.randn(1, 1000, generator=torch.Generator().manual_seed(3))

    def run(seed, others):
        seq = Seq(SamplingParams(seed=seed))
        out = []
        for _ in range(20):
            rows = [Seq(SamplingParams()) for _ in range(others)] + [seq]
            out.append(sample(logits.expand(len(rows), -1).clone(), rows)[-1])
        return out

    assert run(7, 0) == run(7, 5)
    assert run(7, 0) != run(8, 0)


def test_mixed_batch_uses_each_rows_own_parameters():
    logits = LOGITS.expand(3, -1).clone()
    seqs = [Seq(SamplingParams(temperature=0)), Seq(SamplingParams(top_k=1, temperature=2.0)),
            Seq(SamplingParams(min_p=1.0))]
    for _ in range(50):
        assert sample(logits, seqs) == [0, 0, 0]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path, _ = make_model_dir(tmp_path_factory.mktemp("sampler"), "llama", initializer_range=0.3)
    with engine_for(path) as e:
        yield e


def test_engine_seeded_requests_repeat(engine):
    prompt = [256, 5, 6, 7]
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=123, ignore_eos=True)
    a = engine.generate(prompt, params).token_ids
    b = engine.generate(prompt, params).token_ids
    c = engine.generate(prompt, SamplingParams(max_tokens=16, temperature=1.0, seed=124, ignore_eos=True)).token_ids
    assert a == b and a != c


def test_engine_top_k_one_equals_greedy(engine):
    prompt = [256, 9, 8, 7]
    greedy = engine.generate(prompt, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)).token_ids
    top1 = engine.generate(prompt, SamplingParams(max_tokens=16, temperature=3.0, top_k=1, ignore_eos=True))
    assert top1.token_ids == greedy
    assert not math.isnan(top1.ms_per_token)


def test_top_k_one_at_an_exact_tie_keeps_the_token_greedy_picks():
    """Two tokens with equal logits (the tiny model has such rows): greedy takes the lower id, and top-k 1
    must keep that one, not whichever an unstable sort puts first (it differed between CPUs)."""
    logits = torch.full((1, 4096), -5.0)
    logits[0, 202] = logits[0, 341] = 3.0
    for seed in range(20):
        got = sample(logits, [Seq(SamplingParams(temperature=1.0, top_k=1, seed=seed))])
        assert got == [202] == logits.argmax(-1).tolist()
    assert sample(logits, [Seq(SamplingParams(temperature=1.0, top_p=1e-6, seed=1))]) == [202]
