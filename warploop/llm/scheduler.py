"""Continuous batching: which sequences run in the next step.

A step is either a prefill (newly admitted sequences compute their uncached prompt tokens) or a
decode (every running sequence computes one token). Waiting sequences are admitted, oldest first,
while KV blocks, the sequence limit and the token budget (counted before prefix-cache hits) allow;
the first one is admitted past the token budget so a long prompt cannot wait forever.

A prompt with more uncached tokens than `max_prefill_tokens` is prefilled in chunks of that many:
its first chunk runs alone when it is admitted, and from then on its chunks take turns with decode
steps of the running sequences, which keep producing tokens; nothing else is admitted until its
last chunk (a normal prefill step, which samples its first token) has run. When a
decode step needs a block and none is free, the newest running sequence is preempted: its blocks
are freed and it goes back to the front of the queue, to be recomputed (its full blocks usually
still in the prefix cache) when it returns.
"""
from __future__ import annotations

import time
from collections import deque

from warploop.llm.kv_cache import BlockManager
from warploop.llm.sequence import Sequence, Status


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_batch_tokens: int,
                 max_prefill_tokens: int | None = None) -> None:
        self.blocks, self.max_num_seqs, self.max_batch_tokens = blocks, max_num_seqs, max_batch_tokens
        self.max_prefill_tokens = max_prefill_tokens or max_batch_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.prefilling: Sequence | None = None    # admitted, its prompt computed in chunks
        self.chunk_turn = False                     # the last step was a chunk: decode next, if any runs
        self.num_preemptions = 0
        self.num_chunks = 0

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.prefilling)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self) -> tuple[list[Sequence], bool]:
        """(sequences, is_prefill). A prefill step of a sequence whose `chunk_end` is set runs
        only up to there and makes no token."""
        if self.prefilling is not None and not (self.chunk_turn and self.running):
            self.chunk_turn = True
            return [self._chunk(self.prefilling)], True
        self.chunk_turn = False
        batch: list[Sequence] = []
        tokens = 0
        while self.prefilling is None and self.waiting and len(self.running) + len(batch) < self.max_num_seqs:
            seq = self.waiting[0]
            if (batch and tokens + len(seq) > self.max_batch_tokens) or not self.blocks.can_allocate(seq):
                break
            self.blocks.allocate(seq)
            seq.status = Status.RUNNING
            if seq.admitted_at is None:
                seq.admitted_at = time.perf_counter()
            if len(seq) - seq.num_computed_tokens > self.max_prefill_tokens:
                self.waiting.popleft()
                if batch:                  # the others run now; its chunks start with the next step
                    self.prefilling = seq
                    break
                self.chunk_turn = True
                return [self._chunk(seq)], True
            tokens += len(seq) - seq.num_computed_tokens
            batch.append(self.waiting.popleft())
        if batch:
            self.running.extend(batch)
            return batch, True

        while self.running:
            seq = self.running.popleft()
            while not self.blocks.can_append(seq):
                if self.running:
                    self._preempt(self.running.pop())
                else:
                    self._preempt(seq)
                    break
            else:
                self.blocks.append(seq)
                batch.append(seq)
        self.running.extendleft(reversed(batch))
        return batch, False

    def _chunk(self, seq: Sequence) -> Sequence:
        """The next chunk of a prompt prefilled in chunks; its last is a normal prefill, after which
        the sequence decodes with the running ones."""
        self.prefilling = seq
        self.num_chunks += 1
        end = seq.num_computed_tokens + self.max_prefill_tokens
        if end >= len(seq):
            seq.chunk_end, self.prefilling = None, None
            self.running.append(seq)
        else:
            seq.chunk_end = end
        return seq

    def chunk_done(self, seq: Sequence) -> None:
        """A chunk's step completed: its tokens' KV is in the cache."""
        seq.num_computed_tokens, seq.chunk_end = seq.chunk_end, None

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence wherever it is and free its blocks."""
        if seq is self.prefilling:
            self.prefilling = None
            seq.chunk_end = None
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = Status.FINISHED
        self.blocks.free(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.num_preemptions += 1
        seq.status = Status.WAITING
        self.blocks.free(seq)
        self.waiting.appendleft(seq)
