"""The decode loop on the GPU: the graph's last node turns one step's sampled ids into the next
step's inputs, so a graph request of K repeats runs K decode steps with no host message between them.

After sampling, `advance_node` does per live row what the host did between two steps: it streams
the token to pinned host memory, stops the row at one of its stop ids or when its token budget
is spent, and otherwise appends the token (the next step's id, position, context length and RNG
counter), taking a fresh KV block from a free list the host lent when the token starts a block,
and writing the row's new KV slot. When no row is left, or the host asks (its halt word), or a
row needs the host (no free block, or a sampled row the graph cannot draw exactly), it ends the
request through the graph's halt word (Graph.halt_address): the run in flight is the last.

Two blocks, each defined once below (`LoopBlock`, `Mailbox`) with device readers beside them:

**Loop block** (device int32, written by the host before each loop request, then by the node):

| words | field |
|---|---|
| 0 | on: 1 while a loop request runs (0: single steps; the node returns at once) |
| 1 | free: blocks in the free list (F) |
| 2 | next: free-list entries taken so far |
| 3 | step: steps done in this request |
| 4 | steps: the most steps this request may run (K, at most the mailbox's ring) |
| 8 + [0, B) | remaining: tokens the row may still make (max_tokens and the context) |
| 8 + [B, 2B) | done: 1 once the row has stopped |
| 8 + [2B, 3B) | stop ids: how many the row has (at most STOP_WIDTH) |
| 8 + 3B + [0, B * STOP_WIDTH) | the rows' stop ids |
| 8 + 3B + B * STOP_WIDTH + [0, F) | free list: KV block ids |

**Mailbox** (pinned host int32, read by the host while the loop runs):

| words | field |
|---|---|
| 0 | published: steps whose ring rows are complete (written last, with release at system scope) |
| 1 | status: why the request ended (LOOP_* below; 0 while it runs) |
| 2 | halt: the host sets it to end the request after the step in flight |
| 4 + s * 2B + [0, B) | ring row s: each row's token (-2: the row had stopped; -1: host must sample) |
| 4 + s * 2B + B + [0, B) | ring row s: the KV block the row took at that step (-1: none) |
"""
from __future__ import annotations

import dataclasses
import time

import numpy as np
import triton
import triton.language as tl

# the loop's limits and the ring's token words are declared in loop_step.py, where no Triton is imported
from warploop.llm.loop_step import HOST_SAMPLE, MAX_STEPS, NO_TOKEN, STOP_WIDTH  # noqa: F401
from warploop.llm.mk.layout import D_BATCH, D_HEADER, step_field, step_rows, step_table

LOOP_HEADER = 8
L_ON, L_FREE, L_NEXT, L_STEP, L_STEPS = range(5)
MAIL_HEADER = 4
M_PUBLISHED, M_STATUS, M_HALT = range(3)
# why a loop request ended (Mailbox status)
LOOP_RUNNING, LOOP_ALL_STOPPED, LOOP_STEPS, LOOP_NO_BLOCK, LOOP_HOST_SAMPLE, LOOP_HALTED = range(6)


@dataclasses.dataclass(frozen=True)
class LoopBlock:
    """Sizes of one graph's loop block: `batch` rows, `free` free-list entries."""

    batch: int
    free: int

    @property
    def words(self) -> int:
        return LOOP_HEADER + 3 * self.batch + self.batch * STOP_WIDTH + self.free

    def serialize(self, steps: int, remaining: list[int], stops: list[list[int]], free: list[int]) -> np.ndarray:
        b, n = self.batch, len(remaining)
        if not 1 <= n <= b or len(stops) != n:
            raise ValueError(f"a loop of {n} rows ({len(stops)} stop lists) does not fit a graph of batch {b}")
        if len(free) > self.free:
            raise ValueError(f"{len(free)} free blocks exceed the loop block's {self.free}")
        if any(len(s) > STOP_WIDTH for s in stops):
            raise ValueError(f"a row has more than {STOP_WIDTH} stop ids")
        if any(r < 1 for r in remaining) or steps < 1:
            raise ValueError(f"every row needs at least one token to make and the loop a step (got {remaining}, "
                             f"{steps} steps)")
        out = np.zeros(self.words, dtype=np.int32)
        out[[L_ON, L_FREE, L_NEXT, L_STEP, L_STEPS]] = (1, len(free), 0, 0, steps)
        base = LOOP_HEADER
        out[base:base + n] = remaining
        out[base + b:base + 2 * b] = 1                   # padding rows: stopped from the start
        out[base + b:base + b + n] = 0
        out[base + 2 * b:base + 2 * b + n] = [len(s) for s in stops]
        table = out[base + 3 * b:base + 3 * b + b * STOP_WIDTH].reshape(b, STOP_WIDTH)
        for i, s in enumerate(stops):
            table[i, :len(s)] = s
        first = base + 3 * b + b * STOP_WIDTH
        out[first:first + len(free)] = free
        return out


@dataclasses.dataclass(frozen=True)
class Mailbox:
    """Sizes of the pinned mailbox: `batch` rows, a ring of `steps` rows."""

    batch: int
    steps: int

    @property
    def words(self) -> int:
        return MAIL_HEADER + self.steps * 2 * self.batch

    def ring(self, words: np.ndarray, count: int) -> tuple[np.ndarray, np.ndarray]:
        """The first `count` ring rows of a mailbox's words: tokens [count, B], blocks [count, B]."""
        rows = words[MAIL_HEADER:MAIL_HEADER + count * 2 * self.batch].reshape(count, 2, self.batch)
        return rows[:, 0], rows[:, 1]


D_ON, D_FREE, D_NEXT, D_STEP, D_STEPS = (tl.constexpr(v) for v in (L_ON, L_FREE, L_NEXT, L_STEP, L_STEPS))
D_PUBLISHED, D_STATUS, D_HALT = (tl.constexpr(v) for v in (M_PUBLISHED, M_STATUS, M_HALT))
D_LOOP_HEADER, D_STOP_WIDTH, D_MAIL_HEADER = (tl.constexpr(v) for v in (LOOP_HEADER, STOP_WIDTH, MAIL_HEADER))
S_ALL_STOPPED, S_STEPS, S_NO_BLOCK, S_HOST_SAMPLE, S_HALTED = (
    tl.constexpr(v) for v in (LOOP_ALL_STOPPED, LOOP_STEPS, LOOP_NO_BLOCK, LOOP_HOST_SAMPLE, LOOP_HALTED))


@triton.jit
def advance_node(inp, tokens, loop, mail, halt, BS: tl.constexpr, BACKEND: tl.constexpr):
    """One loop step's bookkeeping for every live row (see the module docstring); runs after the
    sample combine, so the next repeat of the graph reads the inputs written here."""
    if tl.load(loop + D_ON) != 0:
        b = tl.load(inp + D_BATCH)
        n = step_rows(inp)
        step = tl.load(loop + D_STEP)
        nfree = tl.load(loop + D_FREE)
        taken = tl.load(loop + D_NEXT)
        rem_p = loop + D_LOOP_HEADER
        done_p = rem_p + b
        nstop_p = rem_p + 2 * b
        stops_p = rem_p + 3 * b
        free_p = stops_p + b * D_STOP_WIDTH
        ring = mail + D_MAIL_HEADER + step * 2 * b
        lanes = tl.arange(0, D_STOP_WIDTH)
        live = 0
        status = 0
        for r in range(n):
            out_tok = -2                            # NO_TOKEN
            new_blk = -1
            if tl.load(done_p + r) == 0:
                tok = tl.load(tokens + r)
                out_tok = tok
                stopped = 1
                if tok < 0:
                    status = S_HOST_SAMPLE          # the host draws this row
                else:
                    rem = tl.load(rem_p + r) - 1
                    tl.store(rem_p + r, rem)
                    ids = tl.load(stops_p + r * D_STOP_WIDTH + lanes, mask=lanes < tl.load(nstop_p + r), other=-1)
                    hit = tl.sum((ids == tok).to(tl.int32), axis=0) > 0
                    if (not hit) & (rem > 0):
                        pos = step_field(inp, 1, r) + 1          # the new token's position
                        table = step_table(inp, r)
                        ok = True
                        if pos % BS == 0:                        # it starts a block: take one
                            if taken < nfree:
                                new_blk = tl.load(free_p + taken)
                                tl.store(table + pos // BS, new_blk)
                                taken += 1
                            else:
                                ok = False
                                status = S_NO_BLOCK          # the host makes room
                        if ok:
                            field = inp + D_HEADER + r
                            tl.store(field, tok)                               # 0: token id
                            tl.store(field + b, pos)                           # 1: position
                            tl.store(field + 2 * b, pos + 1)                   # 2: context length
                            tl.store(field + 3 * b, tl.load(table + pos // BS) * BS + pos % BS)  # 3: KV slot
                            tl.store(field + 11 * b, (pos + 1) & 0x7FFFFFFF)   # 11: the RNG counter
                            stopped = 0
                if stopped != 0:
                    tl.store(done_p + r, 1)
                live += 1 - stopped
            tl.store(ring + r, out_tok)
            tl.store(ring + b + r, new_blk)
        step += 1
        tl.store(loop + D_STEP, step)
        tl.store(loop + D_NEXT, taken)
        asked = tl.load(mail + D_HALT, volatile=True) != 0
        if status == 0:
            if live == 0:
                status = S_ALL_STOPPED
            elif step >= tl.load(loop + D_STEPS):
                status = S_STEPS
            elif asked:
                status = S_HALTED
        if status != 0:
            tl.store(loop + D_ON, 0)                 # single steps after this request find it off
            tl.store(halt, 1)
            tl.store(mail + D_STATUS, status)
        tl.debug_barrier()
        tl.atomic_xchg(mail + D_PUBLISHED, step, sem="release", scope="sys")


class LoopRun:
    """The host's side of one loop request: streams the ring rows as the device publishes them.

    On a GPU the rows arrive while the request runs; on the CPU executor the request runs inside
    the host's waits (they drive that executor), one step per wait.
    """

    POLL_SPIN_S = 200e-6       # spin this long between reads of `published`, then sleep briefly
    NAP = 0.85                 # after a step arrives, sleep this share of a step's time before polling

    def __init__(self, graph, mail, box: Mailbox, rows: int, rt, timeout: float) -> None:
        self.graph, self.box, self.rows, self.rt, self.timeout = graph, box, rows, rt, timeout
        self.words = mail.numpy()
        self.future = None
        self.consumed = 0
        self.progress = time.perf_counter()     # when a row last arrived
        self.step_s = 0.0                       # the time between steps, as seen here (a running mean)

    def start(self, **launch) -> None:
        self.words[:MAIL_HEADER] = 0
        self.progress = time.perf_counter()
        self.future = self.graph.launch(**launch)

    def halt(self) -> None:
        """Ask the device to end the request after the step in flight (a no-op once it has ended)."""
        self.words[M_HALT] = 1

    @property
    def status(self) -> int:
        """Why the request ended (LOOP_*); LOOP_RUNNING until it has."""
        return int(self.words[M_STATUS])

    def finished(self) -> bool:
        """The request has ended and every published row has been taken."""
        return self.future.done() and self.consumed == int(self.words[M_PUBLISHED])

    def take(self, wait_s: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
        """The rows published since the last take, waiting up to `wait_s` for one: tokens and blocks,
        each [new rows, live rows]. Raises the device's fault, or TimeoutError when the request
        makes no progress for the runtime's timeout."""
        start = spin = time.perf_counter()
        while int(self.words[M_PUBLISHED]) == self.consumed and not self.future.done():
            if self.rt.info.target.backend == "cpu":    # runs the request until its next step is out
                self.future.wait(lambda: int(self.words[M_PUBLISHED]) != self.consumed, self.timeout)
                break
            now = time.perf_counter()
            if now - start >= wait_s:
                self.rt.check()                         # a device fault ends the wait with its error
                if now - self.progress > self.timeout:
                    raise TimeoutError(f"the decode loop made no step in {self.timeout:g} s; "
                                       f"{self.rt.status().describe()}")
                return self._empty()
            # sleep through most of a step (the host's CPU is not burnt polling), then poll closely;
            # not once the device has said why the request ends (its last step is out: the request
            # is done within microseconds, and a new request may be waiting for it to end)
            nap = min(self.progress + self.NAP * self.step_s - now, start + wait_s - now) \
                if self.status == LOOP_RUNNING else 0.0
            if nap > self.POLL_SPIN_S:
                time.sleep(nap)
                spin = time.perf_counter()
            elif now - spin > self.POLL_SPIN_S:
                time.sleep(20e-6)
        if self.future.done():
            self.future.result(self.timeout)            # raises the request's fault, if any
        published = int(self.words[M_PUBLISHED])
        tokens, blocks = self.box.ring(self.words, published)
        tokens, blocks = tokens[self.consumed:, :self.rows].copy(), blocks[self.consumed:, :self.rows].copy()
        now = time.perf_counter()
        if len(tokens) and self.consumed:      # the host's view of a step's time (the first waits for the launch)
            per = (now - self.progress) / len(tokens)
            self.step_s = per if not self.step_s else 0.8 * self.step_s + 0.2 * per
        self.consumed = published
        self.progress = now
        return tokens, blocks

    def _empty(self) -> tuple[np.ndarray, np.ndarray]:
        return np.zeros((0, self.rows), np.int32), np.zeros((0, self.rows), np.int32)
