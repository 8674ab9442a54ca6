"""The engine: a loop thread that schedules, runs the backend, samples, and streams tokens out.

Interface in docs/engine-api.md. Requests come in from any thread (add_request, abort); the loop
thread owns the scheduler, the block manager and the backend, and calls each request's callback,
in order, once per generated token.
"""
from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator

from warploop.llm import loop_step
from warploop.llm.backend import Backend, ModelBatch
from warploop.llm.config import ModelConfig
from warploop.llm.detokenizer import Detokenizer
from warploop.llm.engine_config import EngineConfig
from warploop.llm.kv_cache import BlockManager
from warploop.llm.loop_step import LoopStep
from warploop.llm.params import Completion, SamplingParams, StreamEvent
from warploop.llm.parts import load_parts
from warploop.llm.sampler import make_generator, sample_on_device
from warploop.llm.scheduler import Scheduler
from warploop.llm.sequence import Sequence, Status
from warploop.llm.step import Step, follow_up_batch, launch

__all__ = ["Engine", "SamplingParams", "StreamEvent", "Completion"]
# the backend's deferred start work (Backend.idle) waits until the engine has had nothing to do for this
# long, so a fresh server's first requests, which come at once, do not queue behind a piece of it (on
# the H200 a whole split level's build delayed a cold server's second request by 2.3-3.0 s)
DEFERRED_QUIET_S = 0.5
log = logging.getLogger("warploop.llm")


class _Request:
    def __init__(self, seq: Sequence, detok: Detokenizer, on_event: Callable[[StreamEvent], None]) -> None:
        self.seq, self.detok, self.on_event = seq, detok, on_event


class Engine:
    def __init__(self, config: ModelConfig, backend: Backend, tokenizer=None, *, model_name: str = "model",
                 max_context: int, max_num_seqs: int = 32, max_batch_tokens: int = 2048,
                 enable_prefix_caching: bool = True, decode_loop: bool = True, max_prefill_tokens: int = 2048) -> None:
        """decode_loop: where the backend can (Backend.runs_decode_loops: the megakernel), run each decode batch as
        a loop of up to 64 steps on the device, the host only taking tokens out (loop_step.py);
        False: one step per host round trip (a reference, or to debug). max_prefill_tokens: a prompt
        with more uncached tokens is prefilled in chunks of this many, taking turns with decode steps
        of the running requests (Scheduler)."""
        EngineConfig(max_num_seqs=max_num_seqs, max_batch_tokens=max_batch_tokens,   # the same checks
                     max_prefill_tokens=max_prefill_tokens, enable_prefix_caching=enable_prefix_caching,
                     decode_loop=decode_loop)
        layout = backend.layout
        if max_context > layout.num_blocks * layout.block_size:
            raise ValueError(f"max_context {max_context} exceeds the KV cache ({layout.num_blocks} blocks of "
                             f"{layout.block_size} tokens)")
        self.config, self.backend, self.tokenizer, self.model_name = config, backend, tokenizer, model_name
        self.max_context = max_context
        self.decode_loop = decode_loop and backend.runs_decode_loops
        self.vocab_size = config.vocab_size
        self.eos_token_ids = set(config.eos_token_ids) | set(getattr(tokenizer, "eos_token_ids", ()))
        self.blocks = BlockManager(layout.num_blocks, layout.block_size, enable_prefix_caching)
        self.scheduler = Scheduler(self.blocks, max_num_seqs, max_batch_tokens, max_prefill_tokens)
        self._requests: dict[str, _Request] = {}
        self._inbox: list[_Request] = []
        self._aborts: list[str] = []
        self._cv = threading.Condition()
        self._closed = False
        self._counters = {"prompt_tokens_total": 0, "generation_tokens_total": 0, "prefill_tokens_computed": 0,
                          "overlapped_steps": 0, "decode_loops": 0, "decode_loop_tokens": 0}
        # the step in flight, launched but not yet completed: one step, or a decode loop on the device
        self._pending: Step | LoopStep | None = None
        self._settled = threading.Event()      # the backend's deferred start work is done (settle)
        t0 = time.perf_counter()
        backend.warmup(max_num_seqs)
        # seconds each part of the start took, for `warploop serve`'s start line: from_model adds "load"
        # (config, tokenizer, weights on the device) and "backend" (its build), and "backend.NAME" are
        # the backend's own parts of that build (Backend.start_s: the streaming executor's placement)
        self.start_s = {**{f"backend.{k}": v for k, v in backend.start_s.items()}, "warmup": time.perf_counter() - t0}
        self._thread = threading.Thread(target=self._loop, name="warploop-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_model(cls, model: str, config: EngineConfig | None = None, **options) -> Engine:
        """`tiny`, a Hugging Face-format directory or a .gguf file, with the settings of `config` or
        of keyword options (EngineConfig's fields: device, dtype, backend, block_size, num_kv_blocks,
        max_model_len, max_num_seqs, max_batch_tokens, max_prefill_tokens, enable_prefix_caching,
        decode_loop, use_cuda_graphs, tensor_parallel, progress), checked before anything loads."""
        if config is not None and options:
            raise ValueError("pass an EngineConfig or keyword options, not both")
        config = config if config is not None else EngineConfig.from_options(options)
        parts = load_parts(model, config)
        try:
            engine = cls(parts.cfg, parts.backend, parts.tokenizer, model_name=parts.name,
                         max_context=parts.max_context, max_num_seqs=config.max_num_seqs,
                         max_batch_tokens=config.max_batch_tokens, enable_prefix_caching=config.enable_prefix_caching,
                         decode_loop=config.decode_loop, max_prefill_tokens=config.max_prefill_tokens)
            engine.start_s = {**parts.start_s, **engine.start_s}       # load, backend, backend.*, warmup
            return engine
        except BaseException:
            parts.backend.close()   # a tensor-parallel backend's worker processes must not outlive a failed start
            raise

    # ---- requests (any thread) ----

    def add_request(self, prompt_ids: list[int], params: SamplingParams,
                    on_event: Callable[[StreamEvent], None], request_id: str | None = None) -> str:
        self._check(prompt_ids, params)
        if request_id is not None and request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        seq = Sequence(prompt_ids, params, request_id)
        if params.seed is not None:
            seq.generator = make_generator(params.seed, self.backend.device)
        req = _Request(seq, Detokenizer(self.tokenizer, prompt_ids, params.stop), on_event)
        with self._cv:
            if self._closed:
                raise RuntimeError("the engine is closed")
            self._inbox.append(req)
            self._cv.notify()
        return seq.request_id

    def abort(self, request_id: str) -> None:
        with self._cv:
            self._aborts.append(request_id)
            self._cv.notify()

    def stream(self, prompt_ids: list[int], params: SamplingParams) -> Iterator[StreamEvent]:
        events: queue.Queue[StreamEvent] = queue.Queue()
        rid = self.add_request(prompt_ids, params, events.put)
        finished = False
        try:
            while not finished:
                event = events.get()
                finished = event.finish_reason is not None
                yield event
        finally:
            if not finished:
                self.abort(rid)

    def generate(self, prompt: list[int] | str, params: SamplingParams | None = None) -> Completion:
        """Blocking: run one request to its end."""
        params = params or SamplingParams()
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer; pass token ids")
            prompt = self.tokenizer.encode(prompt)
        start = time.perf_counter()
        ids, text, times = [], [], []
        last, queue_ms = None, 0.0
        for event in self.stream(prompt, params):
            if event.token_id is not None:
                ids.append(event.token_id)
                times.append(time.perf_counter())
            if event.queue_ms is not None:
                queue_ms = event.queue_ms
            text.append(event.text_delta)
            last = event
        ttft = (times[0] - start) * 1e3 if times else 0.0
        per_token = (times[-1] - times[0]) * 1e3 / (len(times) - 1) if len(times) > 1 else 0.0
        first_step = (times[1] - times[0]) * 1e3 if len(times) > 1 else 0.0
        return Completion(last.request_id, ids, "".join(text), last.finish_reason, len(prompt), ttft, per_token,
                          last.error, queue_ms, max(0.0, ttft - queue_ms), first_step)

    def stats(self) -> dict:
        with self._cv:
            waiting = len(self._inbox)
        return {"running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting) + waiting,
                "kv_blocks_used": self.blocks.num_used, "kv_blocks_total": self.blocks.num_blocks,
                "prefix_cache_hit_tokens": self.blocks.hit_tokens, **self._counters,
                "preemptions": self.scheduler.num_preemptions, "prefill_chunks": self.scheduler.num_chunks}

    def settle(self, timeout: float | None = 120.0) -> bool:
        """Wait until the backend's deferred start work is done (the engine does it while idle:
        Backend.idle), so what runs next is timed in the steady state; whether it was done within
        `timeout` seconds. Serving does not need it: a request that needs a deferred piece builds it."""
        return self._settled.wait(timeout)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
        if threading.current_thread() is not self._thread:
            if self._thread.is_alive():
                self._thread.join()
            self.backend.close()   # after the loop's last step: it may stop processes that step used

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check(self, prompt_ids: list[int], params: SamplingParams) -> None:
        if not isinstance(params, SamplingParams):
            raise TypeError("params must be a SamplingParams")
        if not prompt_ids:
            raise ValueError("the prompt is empty; it needs at least one token")
        if any(not isinstance(t, int) or not 0 <= t < self.vocab_size for t in prompt_ids):
            raise ValueError(f"prompt token ids must be integers in [0, {self.vocab_size})")
        room = self.max_context - len(prompt_ids)
        if room < (params.max_tokens or 1):
            raise ValueError(f"the prompt ({len(prompt_ids)} tokens) plus max_tokens ({params.max_tokens}) exceeds "
                             f"the context of {self.max_context} tokens")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this engine has none")

    # ---- the loop thread ----

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

    def _emit(self, req: _Request, token: int) -> None:
        seq, params = req.seq, req.seq.params
        if token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids):
            return self._finish(req, token, req.detok.flush(), "stop")
        delta = req.detok.push(token)
        if req.detok.stopped:
            return self._finish(req, token, delta, "stop")
        if (params.max_tokens is not None and seq.num_completion_tokens >= params.max_tokens) or \
                len(seq) >= self.max_context:
            return self._finish(req, token, delta + req.detok.flush(), "length")
        self._deliver(req, StreamEvent(seq.request_id, token, delta, None, seq.num_prompt_tokens,
                                       seq.num_completion_tokens, queue_ms=self._queue_ms(seq)))

    def _finish(self, req: _Request, token: int | None, delta: str, reason: str, error: str | None = None) -> None:
        seq = req.seq
        self.scheduler.finish(seq)
        del self._requests[seq.request_id]
        self._deliver(req, StreamEvent(seq.request_id, token, delta, reason, seq.num_prompt_tokens,
                                       seq.num_completion_tokens, error,
                                       self._queue_ms(seq) if token is not None else None))

    @staticmethod
    def _queue_ms(seq: Sequence) -> float | None:
        """On a request's first token: its wait from add_request to admission, in ms."""
        if seq.num_completion_tokens != 1 or seq.admitted_at is None:
            return None
        return (seq.admitted_at - seq.arrived_at) * 1e3

    @staticmethod
    def _deliver(req: _Request, event: StreamEvent) -> None:
        try:
            req.on_event(event)
        except Exception:  # a broken callback must not stop the loop for everyone else
            log.exception("on_event callback for %s failed", event.request_id)
