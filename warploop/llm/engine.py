"""The engine: a loop thread that schedules, runs the backend, samples, and streams tokens out.

Interface in docs/engine-api.md. Requests come in from any thread (add_request, abort); the loop
thread owns the scheduler, the block manager and the backend, and calls each request's callback,
in order, once per generated token.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator

from warploop.llm.backend import Backend
from warploop.llm.config import ModelConfig
from warploop.llm.detokenizer import Detokenizer
from warploop.llm.engine_config import EngineConfig
from warploop.llm.engine_loop import EngineLoop
from warploop.llm.kv_cache import BlockManager
from warploop.llm.loop_step import LoopStep
from warploop.llm.params import Completion, SamplingParams, SamplingParamsError, StreamEvent
from warploop.llm.parts import load_parts
from warploop.llm.sampler import make_generator
from warploop.llm.scheduler import Scheduler
from warploop.llm.sequence import Sequence
from warploop.llm.step import Step

__all__ = ["Engine", "SamplingParams", "StreamEvent", "Completion"]
log = logging.getLogger("warploop.llm")


class _Request:
    def __init__(self, seq: Sequence, detok: Detokenizer, on_event: Callable[[StreamEvent], None]) -> None:
        self.seq, self.detok, self.on_event = seq, detok, on_event


class Engine(EngineLoop):
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
                          "overlapped_steps": 0, "decode_loops": 0, "decode_loop_tokens": 0, "decode_steps": 0,
                          "prefill_steps": 0}
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
                "preemptions": self.scheduler.num_preemptions, "prefill_chunks": self.scheduler.num_chunks,
                "deferred_pending": int(not self._settled.is_set())}

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
        if room < 1:
            raise ValueError(f"the prompt ({len(prompt_ids)} tokens) fills the context of {self.max_context} tokens "
                             "and leaves no room to generate; shorten the prompt")
        if room < (params.max_tokens or 1):
            raise SamplingParamsError("max_tokens", f"max_tokens ({params.max_tokens}) plus the prompt's "
                                      f"{len(prompt_ids)} tokens exceeds the context of {self.max_context} tokens; "
                                      f"ask for at most {room} or shorten the prompt")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this engine has none")

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
