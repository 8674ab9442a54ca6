"""Continuous batching: which sequences run in the next step.

A step is either a prefill (newly admitted sequences compute their uncached prompt tokens) or a
decode (every running sequence computes one token). Waiting sequences are admitted, oldest first,
while KV blocks, the sequence limit and the token budget (counted before prefix-cache hits) allow;
the first one is admitted past the token budget so a long prompt cannot wait forever. When a
decode step needs a block and none is free, the newest running sequence is preempted: its blocks
are freed and it goes back to the front of the queue, to be recomputed (its full blocks usually
still in the prefix cache) when it returns.
"""
from __future__ import annotations

from collections import deque

from warploop.llm.kv_cache import BlockManager
from warploop.llm.sequence import Sequence, Status


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_batch_tokens: int) -> None:
        self.blocks, self.max_num_seqs, self.max_batch_tokens = blocks, max_num_seqs, max_batch_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.num_preemptions = 0

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self) -> tuple[list[Sequence], bool]:
        """(sequences, is_prefill)."""
        batch: list[Sequence] = []
        tokens = 0
        while self.waiting and len(self.running) + len(batch) < self.max_num_seqs:
            seq = self.waiting[0]
            if (batch and tokens + len(seq) > self.max_batch_tokens) or not self.blocks.can_allocate(seq):
                break
            self.blocks.allocate(seq)
            tokens += len(seq) - seq.num_computed_tokens
            seq.status = Status.RUNNING
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

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence wherever it is and free its blocks."""
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
