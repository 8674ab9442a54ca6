"""A decode loop in flight: up to MAX_STEPS decode steps run on the device with no host message
between them (the megakernel backend's `start_loop`, warploop/llm/mk/loop.py).

The engine plans it (each row's token budget and stop ids, KV blocks lent from the block manager
for the rows to take at block boundaries), then takes the ring rows as the device publishes them:
each row's token is appended and streamed exactly as a single step's would be, each block a row
took joins its block table. Blocks lent but not taken, or taken by a row the host had already
finished, go back to the block manager. The host may end the loop early (an arrival to admit,
an abort, a stop string): the device stops after the step in flight.
"""
from __future__ import annotations

import dataclasses

from warploop.llm.backend import ModelBatch
from warploop.llm.kv_cache import cdiv

MIN_STEPS = 2          # a loop of one step is a single step: leave it to the single-step path
MAX_STEPS = 64         # the most steps one loop request runs (mk/loop.py's mailbox ring's rows)
STOP_WIDTH = 16        # stop ids a row may have (eos and stop_token_ids) to run in the loop
# the ring's words beside a real token (mk/loop.py's kernel and the stream backend write them),
# declared here, where no Triton is imported, so the prebuilt paths read them with no compiler
NO_TOKEN, HOST_SAMPLE = -2, -1      # the row had stopped; the host must sample the row


@dataclasses.dataclass
class LoopStep:
    seqs: list                  # the rows, in batch order
    run: object                 # mk.loop.LoopRun
    lent: list[int]             # KV blocks lent for the loop
    taken: set = dataclasses.field(default_factory=set)
    host_rows: list = dataclasses.field(default_factory=list)   # rows the device left to the host sampler

    def untaken(self) -> list[int]:
        """The lent blocks no row took: they go back to the block manager when the loop ends."""
        return [b for b in self.lent if b not in self.taken]


def plan(seqs: list, eos_ids: set, max_context: int, block_size: int, free_blocks: int):
    """(steps, remaining, stops, blocks to lend) for a loop over `seqs`, or None when one cannot
    run: a row with more stop ids than the device holds, or no row with two tokens to make."""
    remaining, stops, need = [], [], 0
    for seq in seqs:
        p = seq.params
        ids = sorted(set(p.stop_token_ids) | (set() if p.ignore_eos else eos_ids))
        if len(ids) > STOP_WIDTH:
            return None
        budget = max_context - len(seq)
        if p.max_tokens is not None:
            budget = min(budget, p.max_tokens - seq.num_completion_tokens)
        remaining.append(budget)
        stops.append(ids)
    steps = min(MAX_STEPS, max(remaining))
    if steps < MIN_STEPS or min(remaining) < 1:
        return None
    for seq, budget in zip(seqs, remaining, strict=True):
        need += max(0, cdiv(len(seq) + min(steps, budget), block_size) - len(seq.block_table))
    return steps, remaining, stops, min(need, free_blocks)


def start(backend, seqs: list, eos_ids: set, max_context: int, blocks) -> LoopStep | None:
    """Start a loop over the decode batch `seqs` (their blocks already hold each newest token), or
    return None when this batch should take single steps."""
    batch = ModelBatch.from_sequences(seqs)
    if not backend.loop_ready(batch, seqs):
        return None
    planned = plan(seqs, eos_ids, max_context, blocks.block_size, blocks.num_free)
    if planned is None:
        return None
    steps, remaining, stops, lend = planned
    lent = blocks.lend(lend)
    try:
        run = backend.start_loop(batch, seqs, steps, remaining, stops, lent)
    except BaseException:
        blocks.give_back(lent)
        raise
    return LoopStep(seqs, run, lent)


def rows(loop: LoopStep, wait_s: float):
    """Yield (row, token, block) for each row that made a token in each step published since the
    last call, waiting up to `wait_s` for one; token -1: the host samples it (the loop's last
    step); block -1: none taken (a row that had stopped takes none and is left out)."""
    tokens, taken = loop.run.take(wait_s)
    for s in range(len(tokens)):
        for i in range(len(loop.seqs)):
            if tokens[s, i] != NO_TOKEN:
                yield i, int(tokens[s, i]), int(taken[s, i])

