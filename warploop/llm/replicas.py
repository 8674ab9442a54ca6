"""`warploop serve --replicas N`: N engines, each in its own process (and on its own GPUs), behind
one OpenAI endpoint.

`ReplicaPool` stands where the server expects an Engine (add_request, abort, stats, close,
model_name, tokenizer, max_context). It checks a request as one engine would, sends it to the live
replica with the fewest requests in flight (least outstanding requests: queue length, as the
replica's scheduler sees it), and one reader thread per replica hands that replica's events to
their callbacks. A replica whose process exits fails its requests in flight with an error event
(the server answers 500 naming the replica) and takes no more; the others keep serving. When none
is left, add_request raises RuntimeError (the server answers 503).

Replica i sees GPUs [i * T, (i + 1) * T) of the visible ones (T = --tensor-parallel) through
CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES; on the CPU the replicas share the cores.
"""
from __future__ import annotations

import atexit
import dataclasses
import os
import queue
import threading
import time
import uuid
from collections.abc import Callable

from warploop.llm.params import SamplingParams, StreamEvent

START_TIMEOUT_S = 600.0   # load (and on GPUs capture) one engine per replica
STATS_TIMEOUT_S = 5.0
JOIN_TIMEOUT_S = 30.0
POLL_S = 0.5
VISIBLE = {"cuda": "CUDA_VISIBLE_DEVICES", "hip": "HIP_VISIBLE_DEVICES"}


@dataclasses.dataclass(frozen=True)
class ReplicaJob:
    model: str
    options: dict                   # Engine.from_model keywords
    env: dict                       # set in the replica before torch starts (its GPUs)
    threads: int | None             # CPU threads (None: torch's default)


def replica_main(job: ReplicaJob, conn) -> None:
    """Entry point of a replica process: one Engine, driven over `conn`."""
    import multiprocessing

    os.environ.update(job.env)
    if job.threads:
        import torch
        torch.set_num_threads(job.threads)
    from warploop.llm.engine import Engine

    lock = threading.Lock()

    def send(message: tuple) -> None:   # from this thread and the engine's
        with lock:
            conn.send(message)

    try:
        engine = Engine.from_model(job.model, **job.options)
    except Exception as e:
        send(("error", f"{type(e).__name__}: {e}"))
        return
    parent = multiprocessing.parent_process()
    try:
        send(("ready", {"model_name": engine.model_name, "max_context": engine.max_context}))
        while True:
            if not conn.poll(POLL_S):
                if parent is not None and not parent.is_alive():
                    return
                continue
            kind, value = conn.recv()
            if kind == "add":
                rid, prompt_ids, params = value
                try:
                    engine.add_request(prompt_ids, params, lambda event: send(("event", event)), rid)
                except (ValueError, RuntimeError) as e:   # checked by the pool already; reported, not fatal
                    send(("event", StreamEvent(rid, None, "", "abort", len(prompt_ids), 0, str(e))))
            elif kind == "abort":
                engine.abort(value)
            elif kind == "stats":
                send(("stats", engine.stats()))
            elif kind == "close":
                return
    except (EOFError, OSError):   # the pool has gone
        return
    finally:
        engine.close()


class _Replica:
    def __init__(self, index: int, proc, conn) -> None:
        self.index, self.proc, self.conn = index, proc, conn
        self.outstanding: set[str] = set()
        self.alive = True
        self.stats: queue.Queue = queue.Queue()
        self.reader: threading.Thread | None = None

    def send(self, message: tuple) -> None:
        self.conn.send(message)


class ReplicaPool:
    """N engine processes behind the Engine interface the server uses."""

    def __init__(self, model: str, replicas: int, *, device: str | None = None, tensor_parallel: int = 1,
                 **options) -> None:
        import multiprocessing

        from warploop.llm.loader import load_config, open_gguf, resolve_model_dir
        from warploop.llm.tokenizer import Tokenizer

        if replicas < 1:
            raise ValueError(f"--replicas {replicas}: must be at least 1")
        gguf = open_gguf(model)     # a .gguf file: its config and tokenizer, as each replica's engine reads them
        if gguf is not None:
            cfg, self.tokenizer = gguf.config, gguf.tokenizer()
        else:
            path = resolve_model_dir(model)
            cfg = load_config(path)
            self.tokenizer = Tokenizer(path, extra_eos_ids=cfg.eos_token_ids)
        if tensor_parallel != 1:
            from warploop.llm.tp.shard import check
            check(cfg, tensor_parallel)
        self.vocab_size = cfg.vocab_size
        options = dict(options, device=device, tensor_parallel=tensor_parallel, progress=False)
        jobs = [ReplicaJob(model, options, env, threads) for env, threads in
                _placements(device, replicas, tensor_parallel)]
        ctx = multiprocessing.get_context("spawn")
        self._lock = threading.Lock()
        self._stats_lock = threading.Lock()
        self._routes: dict[str, tuple[_Replica, Callable[[StreamEvent], None]]] = {}
        self._closing = False
        self.replicas: list[_Replica] = []
        atexit.register(self.close)
        try:
            for i, job in enumerate(jobs):
                mine, theirs = ctx.Pipe()
                # not a daemon: a replica with --tensor-parallel starts processes of its own
                proc = ctx.Process(target=replica_main, args=(job, theirs), name=f"warploop-replica{i}")
                proc.start()
                theirs.close()
                self.replicas.append(_Replica(i, proc, mine))
            info = [self._ready(r) for r in self.replicas]
        except BaseException:
            self.close()
            raise
        self.model_name, self.max_context = info[0]["model_name"], info[0]["max_context"]
        for r in self.replicas:
            r.reader = threading.Thread(target=self._read, args=(r,), name=f"warploop-replica{r.index}-reader",
                                        daemon=True)
            r.reader.start()

    def _ready(self, replica: _Replica) -> dict:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not replica.conn.poll(POLL_S):
            if not replica.proc.is_alive() and not replica.conn.poll(0):
                raise RuntimeError(f"replica {replica.index} exited with code {replica.proc.exitcode} while "
                                   "loading; see its output above")
            if time.monotonic() > deadline:
                raise RuntimeError(f"replica {replica.index} was not ready within {START_TIMEOUT_S:.0f} s")
        kind, value = replica.conn.recv()
        if kind != "ready":
            raise RuntimeError(f"replica {replica.index} failed to start: {value}")
        return value

    # ---- the Engine interface (any thread) ----

    def add_request(self, prompt_ids: list[int], params: SamplingParams,
                    on_event: Callable[[StreamEvent], None], request_id: str | None = None) -> str:
        from warploop.llm.engine import Engine

        Engine._check(self, prompt_ids, params)   # one engine's own checks, on the attributes they read
        rid = request_id or uuid.uuid4().hex
        with self._lock:
            if self._closing:
                raise RuntimeError("the engine is closed")
            if rid in self._routes:
                raise ValueError(f"request id {rid!r} is already in use")
            live = [r for r in self.replicas if r.alive]
            if not live:
                raise RuntimeError("every replica has exited; restart the server")
            replica = min(live, key=lambda r: len(r.outstanding))
            replica.outstanding.add(rid)
            self._routes[rid] = (replica, on_event)
        try:
            replica.send(("add", (rid, list(prompt_ids), params)))
        except OSError:   # it died just now: its reader fails this request with the others
            pass
        return rid

    def abort(self, request_id: str) -> None:
        with self._lock:
            route = self._routes.get(request_id)
        if route is not None:
            try:
                route[0].send(("abort", request_id))
            except OSError:
                pass

    def stats(self) -> dict:
        """The live replicas' stats, summed; `replicas_alive` counts them."""
        total: dict = {"replicas_alive": 0}
        with self._stats_lock:
            for r in [r for r in self.replicas if r.alive]:
                try:
                    r.send(("stats", None))
                    one = r.stats.get(timeout=STATS_TIMEOUT_S)
                except (OSError, queue.Empty):
                    continue
                total["replicas_alive"] += 1
                for key, value in one.items():
                    total[key] = total.get(key, 0) + value
        return total

    def close(self) -> None:
        """Close every replica (their requests end with "abort"), then stop the processes; idempotent."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
        atexit.unregister(self.close)
        for r in self.replicas:
            try:
                r.send(("close", None))
            except OSError:
                pass
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        for r in self.replicas:
            r.proc.join(max(0.0, deadline - time.monotonic()))
            if r.proc.is_alive():
                r.proc.kill()
                r.proc.join(JOIN_TIMEOUT_S)
            if r.reader is not None:
                r.reader.join(JOIN_TIMEOUT_S)
            r.conn.close()

    def __enter__(self) -> ReplicaPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- one reader thread per replica ----

    def _read(self, replica: _Replica) -> None:
        while True:
            try:
                if not replica.conn.poll(POLL_S):
                    if not replica.proc.is_alive() and not replica.conn.poll(0):
                        break
                    continue
                kind, value = replica.conn.recv()
            except (EOFError, OSError):
                break
            if kind == "stats":
                replica.stats.put(value)
            elif kind == "event":
                self._deliver(replica, value)
        self._died(replica)

    def _deliver(self, replica: _Replica, event: StreamEvent) -> None:
        with self._lock:
            route = self._routes.get(event.request_id)
            if route is None:
                return
            if event.finish_reason is not None:
                del self._routes[event.request_id]
                replica.outstanding.discard(event.request_id)
        route[1](event)

    def _died(self, replica: _Replica) -> None:
        replica.proc.join(JOIN_TIMEOUT_S)
        with self._lock:
            replica.alive = False
            lost = [(rid, self._routes.pop(rid)[1]) for rid in list(replica.outstanding) if rid in self._routes]
            replica.outstanding.clear()
            closing = self._closing
        error = None if closing else (f"replica {replica.index} (pid {replica.proc.pid}) exited with code "
                                      f"{replica.proc.exitcode}; the other replicas keep serving, retry")
        for rid, on_event in lost:
            on_event(StreamEvent(rid, None, "", "abort", 0, 0, error))


def _placements(device: str | None, replicas: int, tensor_parallel: int) -> list[tuple[dict, int | None]]:
    """(environment, CPU threads) per replica: its share of the GPUs, or of the cores."""
    from warploop.target import probe_devices, select_device

    backend = select_device(device).target.backend
    if backend == "cpu":
        return [({}, max(1, (os.cpu_count() or 1) // (replicas * tensor_parallel)))] * replicas
    need = replicas * tensor_parallel
    count = sum(d.target.backend == backend for d in probe_devices())
    if count < need:
        raise ValueError(f"--replicas {replicas} x --tensor-parallel {tensor_parallel} needs {need} GPUs but "
                         f"{count} are visible; lower them or set {VISIBLE[backend]}")
    var = VISIBLE[backend]
    visible = os.environ.get(var)
    ids = visible.split(",") if visible else [str(i) for i in range(count)]
    return [({var: ",".join(ids[i * tensor_parallel:(i + 1) * tensor_parallel])}, None) for i in range(replicas)]
