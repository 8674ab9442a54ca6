"""Token selection on the device, for a whole batch at once, each row with its own parameters.

Order as in transformers: repetition penalty, temperature, top-k, top-p, min-p, then a draw. The
draw is an exponential race (argmax of p / E, E ~ Exp(1)), which picks token i with probability
p_i without normalising; a request with a seed draws its E from its own generator, so its output
does not depend on what else is in the batch.
"""
from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class SampleRow:
    """What the sampler reads of a sequence: its parameters, its tokens so far (the repetition
    penalty's history) and its generator (None: the global one). A Sequence has these three fields;
    a caller that samples a row with other parameters than its sequence's passes one of these."""
    params: object
    token_ids: list[int]
    generator: torch.Generator | None = None

    @classmethod
    def of(cls, seq, **params) -> SampleRow:
        """The row of `seq`, with `params` replacing fields of its SamplingParams."""
        return cls(dataclasses.replace(seq.params, **params), seq.token_ids, seq.generator)


def sample(logits: torch.Tensor, seqs: list) -> list[int]:
    """logits [B, V] float32 -> one token id per sequence or SampleRow (.params, .token_ids, .generator)."""
    return sample_on_device(logits, seqs).tolist()


def sample_on_device(logits: torch.Tensor, seqs: list) -> torch.Tensor:
    """Like sample, but the ids stay on the device (int64 [B]), so the next step can read them there."""
    params = [s.params for s in seqs]
    penalised = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
    if penalised:
        logits = logits.clone()
        for i in penalised:
            seen = torch.tensor(sorted(set(seqs[i].token_ids)), dtype=torch.long, device=logits.device)
            row = logits[i, seen]
            penalty = params[i].repetition_penalty
            logits[i, seen] = torch.where(row > 0, row / penalty, row * penalty)
    greedy = logits.argmax(dim=-1)
    if all(p.greedy for p in params):
        return greedy

    def column(values, dtype=torch.float32):
        return torch.tensor(values, dtype=dtype, device=logits.device)[:, None]

    temperature = column([p.temperature if p.temperature > 0 else 1.0 for p in params])
    probs = torch.softmax(logits / temperature, dim=-1)
    vocab = probs.shape[-1]
    if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
        # stable: tied tokens keep id order, so top-k at a tie keeps the lowest ids, as argmax (greedy)
        # picks the lowest (an unstable sort's order among ties follows the CPU's sort kernel)
        sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)
        rank = torch.arange(vocab, device=logits.device)[None, :]
        drop = rank >= column([p.top_k if p.top_k > 0 else vocab for p in params], torch.long)
        # drop a token when the tokens ranked above it already hold top_p of the mass (top_p = 1: never,
        # even where the float cumulative sum reaches 1 before the tail)
        mass_above = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop |= mass_above >= column([p.top_p if p.top_p < 1 else 2.0 for p in params])
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs.masked_fill(drop, 0.0))
    if any(p.min_p > 0 for p in params):
        floor = column([p.min_p for p in params]) * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < floor, 0.0)
    noise = torch.empty_like(probs).exponential_()
    for i, seq in enumerate(seqs):
        if seq.generator is not None:
            noise[i].exponential_(generator=seq.generator)
    drawn = (probs / noise).argmax(dim=-1)
    is_greedy = torch.tensor([p.greedy for p in params], device=logits.device)
    return torch.where(is_greedy, greedy, drawn)


def make_generator(seed: int, device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)
