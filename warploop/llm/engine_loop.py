"""The engine's loop thread (EngineLoop, a base of engine.Engine): it takes requests and aborts from
the inbox, does the backend's deferred start work while nothing waits, and advances the step
pipeline: schedules a batch, launches it ahead of the step before it (single steps, or a decode
loop the GPU runs), samples, and hands each token to Engine._emit. The request API and the streams'
delivery are in engine.py.
"""
from __future__ import annotations

import collections
import logging
import time

from warploop.llm import loop_step
from warploop.llm.backend import ModelBatch
from warploop.llm.loop_step import LoopStep
from warploop.llm.sampler import sample_on_device
from warploop.llm.sequence import Sequence, Status
from warploop.llm.step import Step, follow_up_batch, launch

# the backend's deferred start work (Backend.idle) waits until the engine has had nothing to do for this
# long, so a fresh server's first requests, which come at once, do not queue behind a piece of it (on
# the H200 a whole split level's build delayed a cold server's second request by 2.3-3.0 s)
DEFERRED_QUIET_S = 0.5
log = logging.getLogger("warploop.llm")


class EngineLoop:
    """The loop thread's methods; Engine holds the state they use (scheduler, backend, requests, the
    pending step) and the request side."""


    def _loop(self) -> None:
        deferred = True         # the backend's deferred start work (Backend.idle), done while no request waits
        quiet_from = time.monotonic()       # when the engine last had work (or started)
        while True:
            with self._cv:
                while not (busy := self._closed or self._inbox or self._aborts or self.scheduler.has_work()
                           or self._pending):
                    if not deferred:
                        self._cv.wait()
                        continue
                    left = quiet_from + DEFERRED_QUIET_S - time.monotonic()
                    if left <= 0:
                        break
                    self._cv.wait(left)
                inbox, self._inbox = self._inbox, []
                aborts, self._aborts = self._aborts, []
                closed = self._closed
            if not busy:        # outside the lock: a request may arrive meanwhile, and waits for this piece
                deferred = self._idle()
                if not deferred:
                    self._settled.set()
                continue
            for req in inbox:
                self._requests[req.seq.request_id] = req
                self._counters["prompt_tokens_total"] += req.seq.num_prompt_tokens
                self.scheduler.add(req.seq)
            for rid in aborts + (list(self._requests) if closed else []):
                if rid in self._requests:
                    self._finish(self._requests[rid], None, "", "abort")
            if closed:
                self._settled.set()
                if isinstance(self._pending, LoopStep):
                    self._pending.run.halt()
                return
            try:
                self._advance()
            except Exception as e:  # a bug here must not leave every client waiting forever
                self._pending = None
                self._fail([req.seq for req in list(self._requests.values())], e)
            quiet_from = time.monotonic()

    def _idle(self) -> bool:
        """One piece of the backend's deferred start work; whether more remains. A failure is left to
        the launch that needs the piece (it builds it then, and its error reaches the request)."""
        try:
            return bool(self.backend.idle())
        except Exception as e:
            log.warning("deferred start work failed (%s: %s); it is retried when a launch needs it",
                        type(e).__name__, e)
            return False

    def _advance(self) -> None:
        """Launch the next step; complete the one in flight. When the next step is a decode of the
        same sequences, it is launched first, from the device-side ids, and overlaps the completion."""
        pending, self._pending = self._pending, None
        if isinstance(pending, LoopStep):
            done, following = self._drive_loop(pending)
            self._pending = following if done else pending
            return
        if pending is None:
            if self.scheduler.has_work():
                self._pending = self._launch_scheduled()
            return
        follow = self._follow_up_seqs(pending)
        if follow:
            self._pending = self._launch(follow_up_batch(pending, follow), follow, prefill=False, ahead=1)
            self._counters["overlapped_steps"] += self._pending is not None
        self._complete(pending)

    def _launch_scheduled(self) -> Step | None:
        seqs, prefill = self.scheduler.schedule()
        if not seqs:  # cannot happen while every request fits the pool alone (checked in add_request)
            seq = self.scheduler.waiting[0]
            self._finish(self._requests[seq.request_id], None, "", "abort", error="does not fit the KV cache")
            return None
        if not prefill and not self.scheduler.waiting and self.scheduler.prefilling is None and self.decode_loop:
            loop = self._start_loop(seqs)
            if loop is not None:
                return loop
        partial = prefill and seqs[0].chunk_end is not None
        return self._launch(ModelBatch.from_sequences(seqs), seqs, prefill, partial=partial)

    # ---- the decode loop on the device (loop_step.py) ----

    def _start_loop(self, seqs: list[Sequence]) -> LoopStep | None:
        try:
            loop = loop_step.start(self.backend, seqs, self.eos_token_ids, self.max_context, self.blocks)
        except Exception as e:      # the single-step path runs these sequences instead
            log.warning("starting a decode loop failed (%s: %s); taking single steps", type(e).__name__, e)
            return None
        if loop is not None:
            self._counters["decode_loops"] += 1
        return loop

    def _drive_loop(self, loop: LoopStep) -> tuple[bool, LoopStep | None]:
        """Take the rows the device has published: tokens out, blocks into tables. Ask the device to
        end the loop when the host needs the batch back (an arrival, an abort, a stop string).
        Returns (whether the loop has ended and everything it made has been taken, the loop that
        follows it, already launched, or None)."""
        seqs = loop.seqs
        try:
            if self.scheduler.waiting or any(s.status is not Status.RUNNING for s in seqs):
                loop.run.halt()
            rows = list(loop_step.rows(loop, wait_s=0.002))
            if rows and loop.run.finished() and self._follows(loop, rows):
                return True, self._launch_then_emit(loop, rows)
            for i, token, block in rows:
                seq = seqs[i]
                if block >= 0:
                    loop.taken.add(block)
                    if seq.status is Status.RUNNING:
                        seq.block_table.append(block)      # the lent block's reference is the sequence's
                    else:
                        self.blocks.give_back([block])
                if seq.status is not Status.RUNNING:
                    continue
                if token < 0:
                    loop.host_rows.append(i)
                    continue
                self._counters["decode_loop_tokens"] += 1
                self._accept(seq, token)
                if seq.status is not Status.RUNNING:
                    loop.run.halt()         # finished here first (a stop string): the device stops soon
            if not loop.run.finished():
                return False, None
        except Exception as e:
            loop.run.halt()
            self.blocks.give_back(loop.untaken())
            self._fail(seqs, e)
            return True, None
        self.blocks.give_back(loop.untaken())
        rows = [i for i in loop.host_rows if seqs[i].status is Status.RUNNING]
        if rows:
            tokens = sample_on_device(self.backend.loop_logits(rows), [seqs[i] for i in rows]).tolist()
            for i, token in zip(rows, tokens, strict=True):
                self._accept(seqs[i], token)
        return True, None

    def _follows(self, loop: LoopStep, rows: list) -> bool:
        """Whether the next loop over the same rows may launch before this one's tokens reach the
        clients: nothing waits to be admitted, every row made a token and none of them ends its
        request (no stop id, budget or context end; no stop string, which only the text shows)."""
        if (self.scheduler.waiting or self._inbox or self._aborts or self.scheduler.prefilling is not None
                or len(self.scheduler.running) != len(loop.seqs)):
            return False
        last = {}
        for i, token, _ in rows:
            if token < 0:                    # the host samples this row: the next loop needs its token
                return False
            last[i] = token
        made = collections.Counter(i for i, _, _ in rows)
        for i, seq in enumerate(loop.seqs):
            p = seq.params
            if (i not in last or seq.status is not Status.RUNNING or p.stop or last[i] in p.stop_token_ids
                    or (not p.ignore_eos and last[i] in self.eos_token_ids)
                    or len(seq) + made[i] >= self.max_context
                    or (p.max_tokens is not None and seq.num_completion_tokens + made[i] >= p.max_tokens)):
                return False
        return True

    def _launch_then_emit(self, loop: LoopStep, rows: list) -> LoopStep | None:
        """A finished loop whose rows all go on (`_follows`): its tokens and blocks into the
        sequences, the next loop launched from them, then the tokens' events (detokenizing and
        streaming take the host longer than the launch: the device works meanwhile). Each token's
        event sees its sequence as it was at that token, as in `_accept`."""
        made = []
        for i, token, block in rows:
            seq = loop.seqs[i]
            if block >= 0:
                loop.taken.add(block)
                seq.block_table.append(block)
            self._counters["decode_loop_tokens"] += 1
            self._counters["generation_tokens_total"] += 1
            made.append((seq, len(seq.token_ids)))
            seq.num_computed_tokens = len(seq.token_ids)
            self.blocks.commit(seq)
            seq.token_ids.append(token)
        self.blocks.give_back(loop.untaken())
        following = self._start_loop(loop.seqs)
        for seq, at in made:
            later = seq.token_ids[at + 1:]
            del seq.token_ids[at + 1:]
            self._emit(self._requests[seq.request_id], seq.token_ids[at])
            seq.token_ids.extend(later)
        return following

    def _launch(self, batch: ModelBatch, seqs: list[Sequence], prefill: bool, ahead: int = 0,
                partial: bool = False) -> Step | None:
        for seq in seqs if ahead else ():
            self.blocks.append(seq, ahead)
        try:
            return launch(self.backend, batch, seqs, prefill, partial)
        except Exception as e:
            if ahead:  # drop the overlapped step: the regular path runs these sequences next, isolating on failure
                log.warning("overlapped decode step failed (%s: %s); running it unoverlapped", type(e).__name__, e)
            elif len(seqs) == 1:
                self._fail(seqs, e)
            else:
                self._isolate(seqs, prefill, e)
            return None

    def _isolate(self, seqs: list[Sequence], prefill: bool, error: Exception) -> None:
        """A batched step failed: run its sequences one at a time, so that a request at fault
        (parameters no check caught) fails alone and the others go on."""
        log.warning("a step of %d requests failed (%s: %s); running them one by one", len(seqs),
                    type(error).__name__, error)
        for seq in seqs:
            try:
                step = launch(self.backend, ModelBatch.from_sequences([seq]), [seq], prefill)
            except Exception as e:
                self._fail([seq], e)
                continue
            self._complete(step)

    def _follow_up_seqs(self, step: Step) -> list[Sequence]:
        """The sequences that decode right after `step` without the host seeing its ids: all of the
        running ones unless the batch must change (arrivals, preemption, host-side sampling state);
        those whose token from `step` is certainly their last are left out."""
        seqs = step.seqs
        if (step.prefill or self.scheduler.waiting or self.scheduler.prefilling is not None
                or len(self.scheduler.running) != len(seqs)
                or any(s.status is not Status.RUNNING or s.params.repetition_penalty != 1.0 for s in seqs)):
            return []
        going = [s for s in seqs if len(s) + 1 < self.max_context and
                 (s.params.max_tokens is None or s.num_completion_tokens + 1 < s.params.max_tokens)]
        return going if self.blocks.can_append_all(going, ahead=1) else []

    def _complete(self, step: Step) -> None:
        try:
            tokens = step.result()
        except Exception as e:
            self._fail(step.seqs, e)
            return
        self._counters["prefill_steps" if step.prefill else "decode_steps"] += 1
        if step.prefill:
            self._counters["prefill_tokens_computed"] += len(step.batch.token_ids)
        if step.partial:                        # a prompt's chunk: its KV is in, no token yet
            for seq in step.seqs:
                if seq.status is Status.RUNNING:
                    self.scheduler.chunk_done(seq)
                    self.blocks.commit(seq)
            return
        for seq, token in zip(step.seqs, tokens, strict=True):
            if seq.status is not Status.RUNNING:  # finished or aborted while the step was in flight
                continue
            self._accept(seq, token)

    def _accept(self, seq: Sequence, token: int) -> None:
        """A running sequence's next token: the KV of every token before it is in the cache."""
        self._counters["generation_tokens_total"] += 1
        seq.num_computed_tokens = len(seq.token_ids)
        self.blocks.commit(seq)
        seq.token_ids.append(token)
        self._emit(self._requests[seq.request_id], token)

    def _fail(self, seqs: list[Sequence], error: Exception) -> None:
        log.exception("engine step failed")
        for seq in seqs:
            if seq.request_id in self._requests:
                self._finish(self._requests[seq.request_id], None, "", "abort",
                             error=f"{type(error).__name__}: {error}")
