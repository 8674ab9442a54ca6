"""The seam between the engine and whatever runs the model.

The engine hands a backend one `ModelBatch` per step (host-side lists: what to compute and where
its KV lives) and gets logits back. The per-op PyTorch backend (backend_torch.py) is one
implementation, the decode megakernel (mk/backend.py) another, under the same contract:

- `forward` writes the KV of every token in the batch to its slot in the paged cache, attends
  over the sequence's whole context through its block table, and returns float32 logits for the
  rows `logits_indices` names (default: the last token of each sequence), in that order. The
  logits may live in the backend's own buffer (the per-op backend's CUDA-graph output): they are
  valid until the next `forward`, so a caller that keeps them across steps copies them.
- KV for positions before `context_len - query_len` is already in the cache (earlier steps or
  prefix-cache hits) and must be read from there, never recomputed.
"""
from __future__ import annotations

import abc
import dataclasses
from collections.abc import Mapping
from types import MappingProxyType

from warploop.llm.config import ModelConfig
from warploop.llm.kv_cache import KVCacheLayout


def first_token_rows(batch: ModelBatch, seqs) -> list[int]:
    """Rows of `batch` that draw their sequence's first completion token (the step ends at the
    prompt's last token). A prefill whose other tokens were cached runs one token, the shape of a
    decode row: a backend that samples decode rows on the device sends these to the host sampler, as
    every prefill's, so a seeded request's first token does not depend on a prefix-cache hit."""
    return [i for i, (seq, n) in enumerate(zip(seqs, batch.context_lens, strict=True)) if n == seq.num_prompt_tokens]


@dataclasses.dataclass
class ModelBatch:
    token_ids: list[int] | object     # flat over sequences: the tokens to run this step (a device
                                      # tensor when they were sampled by the step before, not yet on the host)
    positions: list[int]              # their positions in their sequences
    query_lens: list[int]             # per sequence: how many of token_ids are its
    context_lens: list[int]           # per sequence: tokens with KV after this step (cached + new)
    block_tables: list[list[int]]     # per sequence: its KV blocks, in order
    logits_indices: list[int] | None = None   # rows of token_ids to return logits for

    @classmethod
    def from_sequences(cls, seqs) -> ModelBatch:
        """Each sequence runs its tokens from `num_computed_tokens` to its end (a chunked prefill's
        step: to its `chunk_end`)."""
        tokens, positions, qlens, clens, tables = [], [], [], [], []
        for seq in seqs:
            start, end = seq.num_computed_tokens, len(seq.token_ids)
            if getattr(seq, "chunk_end", None) is not None:
                end = seq.chunk_end
            tokens += seq.token_ids[start:end]
            positions += range(start, end)
            qlens.append(end - start)
            clens.append(end)
            tables.append(seq.block_table)
        return cls(tokens, positions, qlens, clens, tables)

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def is_decode(self) -> bool:
        return len(self.token_ids) == len(self.query_lens)

    def rows_for_logits(self) -> list[int]:
        if self.logits_indices is not None:
            return self.logits_indices
        ends, total = [], 0
        for q in self.query_lens:
            total += q
            ends.append(total - 1)
        return ends

    def slot_mapping(self, block_size: int):
        """The KV slot (block * block_size + offset) of each token in token_ids (int64 numpy array)."""
        import numpy as np

        parts = []
        for qlen, clen, table in zip(self.query_lens, self.context_lens, self.block_tables, strict=True):
            pos = np.arange(clen - qlen, clen)
            parts.append(np.asarray(table, dtype=np.int64)[pos // block_size] * block_size + pos % block_size)
        return np.concatenate(parts)


class Backend(abc.ABC):
    """Runs the model on one device over a paged KV cache of `layout`."""

    name = "torch"      # what --backend calls it (warploop generate --json reports it)
    # seconds of the parts of its build worth naming (Engine.start_s); a backend that times some sets its own
    start_s: Mapping[str, float] = MappingProxyType({})

    def __init__(self, config: ModelConfig, layout: KVCacheLayout, device) -> None:
        self.config, self.layout, self.device = config, layout, device

    @abc.abstractmethod
    def forward(self, batch: ModelBatch):
        """float32 logits [len(batch.rows_for_logits()), vocab_size] (a torch.Tensor on the device),
        valid until the next forward."""

    def forward_sample(self, batch: ModelBatch, seqs: list):
        """forward, then one token id per sequence (int64 [len(seqs)] on the device), each drawn with
        its sequence's parameters (warploop/llm/sampler.py). A backend that samples inside its own
        step (the megakernel) overrides this."""
        from warploop.llm.sampler import sample_on_device
        return sample_on_device(self.forward(batch), seqs)

    # ---- the decode loop on the device: a backend that runs a decode batch's steps without the host
    # between them (the megakernel) overrides the three methods below; the engine then drives the loop
    # through warploop/llm/loop_step.py, and takes single steps wherever loop_ready says no.

    @property
    def runs_decode_loops(self) -> bool:
        """Whether this backend implements the decode loop (overrides start_loop)."""
        return type(self).start_loop is not Backend.start_loop

    def loop_ready(self, batch: ModelBatch, seqs: list) -> bool:
        """Whether this decode batch can run as a loop on the device now."""
        return False

    def start_loop(self, batch: ModelBatch, seqs: list, steps: int, remaining: list[int],
                   stops: list[list[int]], free: list[int]):
        """Start up to `steps` decode steps of `batch` on the device and return at once with the run
        (loop_step.LoopStep reads its tokens as they arrive). remaining: per row, the most tokens it may
        make; stops: per row, the ids that stop it; free: KV blocks the rows take, in order, as they
        cross block boundaries. Called only after loop_ready said yes."""
        raise NotImplementedError(f"{type(self).__name__} runs no decode loop (loop_ready is False)")

    def loop_logits(self, rows: list[int]):
        """The latest loop step's float32 logits of these rows (a loop that ended for host sampling)."""
        raise NotImplementedError(f"{type(self).__name__} runs no decode loop (loop_ready is False)")

    def warmup(self, max_num_seqs: int) -> None:  # noqa: B027 (an optional hook)
        """Compile and capture ahead of serving (CUDA graphs, kernels); a no-op where nothing is needed."""

    def idle(self) -> bool:
        """One piece of work the backend deferred from its start (the engine calls it while no request
        waits, in its loop thread, until it returns False); False where there is none."""
        return False

    def close(self) -> None:  # noqa: B027 (an optional hook)
        """Release what the backend started (the megakernel's resident runtime, tensor-parallel worker
        processes); idempotent; Engine.close calls it after the loop's last step."""
