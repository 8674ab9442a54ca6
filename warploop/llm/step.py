"""One engine step in flight: launched on the device, its sampled ids copied back asynchronously.

Splitting launch from completion lets the engine launch decode step n + 1 (reading step n's ids
straight from device memory) before it waits for step n's ids on the host, so the host's work
(stop checks, detokenising, callbacks) overlaps the device's instead of adding to it.
"""
from __future__ import annotations

import dataclasses

import torch

from warploop.llm.backend import Backend, ModelBatch


@dataclasses.dataclass
class Step:
    seqs: list                      # the sequences it computes, in batch order
    batch: ModelBatch
    prefill: bool
    tokens: torch.Tensor            # sampled ids on the device, int64 [len(seqs)]
    host: torch.Tensor              # where they arrive on the host
    ready: torch.cuda.Event | None  # recorded after the copy; None on the CPU
    partial: bool = False           # a chunk of a prompt: it computes KV and makes no token

    def result(self) -> list[int]:
        """Wait for this step's ids (only for them: later steps keep running)."""
        if self.ready is not None:
            self.ready.synchronize()
        return self.host.tolist()


def launch(backend: Backend, batch: ModelBatch, seqs: list, prefill: bool, partial: bool = False) -> Step:
    """partial: a prompt's chunk (Scheduler: chunk_end), run for its KV, no token sampled (a seeded
    request's random stream is the unchunked one's)."""
    if partial:
        backend.forward(batch)
        done = torch.empty(0, dtype=torch.int64)
        return Step(seqs, batch, prefill, done, done, None, partial=True)
    tokens = backend.forward_sample(batch, seqs)
    if tokens.is_cuda:
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
    else:
        host, ready = tokens, None
    return Step(seqs, batch, prefill, tokens, host, ready)


def follow_up_batch(step: Step, seqs: list) -> ModelBatch:
    """The decode batch after `step` for `seqs` (a subset, in order), whose newest ids are still
    only on the device: each sequence's next token sits at position len(seq)."""
    keep = {id(s) for s in seqs}
    rows = [i for i, seq in enumerate(step.seqs) if id(seq) in keep]
    ids = step.tokens if len(rows) == len(step.seqs) else step.tokens[torch.tensor(rows, device=step.tokens.device)]
    return ModelBatch(ids, [len(s) for s in seqs], [1] * len(seqs), [len(s) + 1 for s in seqs],
                      [s.block_table for s in seqs])
