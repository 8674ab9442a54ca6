"""The host server: one thread that answers the device's calls.

Each pass scans the STATE word of every port at once (one numpy compare), takes every POSTED
request, and answers them together: prints are formatted and written with one write and one
flush, quick requests (time, open, close, inline and vectorized functions) are done on this
thread and replied to with a handful of numpy stores, and slow ones (host functions by default,
file reads and writes) go to a thread pool that replies when done, so one slow callback never
holds up the others. Nothing here allocates GPU memory.

When idle the thread spins for `spin_us` (the device's next call usually comes within a few
microseconds), then sleeps on an event with a timeout that doubles up to `max_sleep_us`. The
device cannot wake a host thread, so the timeout is the doorbell: every wake-up re-scans all
ports, and a request posted at any moment is seen at the latest one timeout later.
"""
from __future__ import annotations

import concurrent.futures
import logging
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable

import numpy as np

from warploop.std import handlers as H
from warploop.std.files import FileTable
from warploop.std.memory import Buffers
from warploop.std.protocol import (
    ARGC_MASK,
    FLOAT_MASK_SHIFT,
    PORT_WORDS,
    WANT_FLOAT_BIT,
    Opcode,
    State,
    Status,
    StdError,
    Word,
    float_to_word,
    word_to_float,
)

log = logging.getLogger("warploop.std")
_servers: weakref.WeakSet[HostServer] = weakref.WeakSet()

# on_reply(port, then, status, result_word): called after an async request with a continuation
# token has been answered, so the runtime can resume that continuation.
ReplyHook = Callable[[int, int, int, int], None]


def ring_doorbells() -> None:
    """Wake every running server now. Called by device code under the Triton interpreter, where the
    "device" is a thread of this process and can do what a GPU cannot."""
    for server in list(_servers):
        server.notify()


# The hot path indexes with plain ints: an IntEnum member lookup costs as much as a numpy store.
_STATE, _RESULT, _STATUS, _SEQ, _OPCODE, _CALL_ID, _WORKER, _FLAGS, _THEN, _PAYLOAD = (int(w) for w in Word)
_POSTED, _TAKEN, _DONE = int(State.POSTED), int(State.TAKEN), int(State.DONE)
_PRINT, _CALL, _READ, _WRITE = int(Opcode.PRINT), int(Opcode.CALL), int(Opcode.READ), int(Opcode.WRITE)


def _decode_args(row: list[int]) -> list:
    flags = row[_FLAGS]
    mask = flags >> FLOAT_MASK_SHIFT
    payload = row[_PAYLOAD:_PAYLOAD + (flags & ARGC_MASK)]
    return [word_to_float(w) if mask >> i & 1 else w for i, w in enumerate(payload)]


def _encode(value, flags: int) -> int:
    if flags & WANT_FLOAT_BIT:
        try:
            return float_to_word(0.0 if value is None else value)
        except (TypeError, ValueError, OverflowError) as e:
            raise StdError(Status.CALLBACK_ERROR, f"returned {value!r}, which is not a float") from e
    return H.check_int64(value)


class HostServer:
    """Answers device calls on `ports` (an int64 host tensor [n, PORT_WORDS], see protocol.py)."""

    def __init__(self, ports, *, files: FileTable | None = None, buffers: Buffers | None = None,
                 functions: dict[str, Callable | H.HostFunction] | None = None, out=None,
                 pool_workers: int = 8, spin_us: float | None = None, max_sleep_us: float = 1000.0,
                 on_reply: ReplyHook | None = None) -> None:
        if ports.dim() != 2 or ports.shape[1] != PORT_WORDS or ports.is_cuda:
            raise ValueError(f"ports must be a host int64 tensor [n, {PORT_WORDS}]; use protocol.allocate_ports()")
        self.ports = ports
        self._words = ports.numpy()
        self._state = self._words[:, _STATE]
        self.handlers = H.Handlers(files or FileTable(), buffers or Buffers())
        self.out = out
        self.on_reply = on_reply
        if spin_us is None:   # under the interpreter the device rings instead: spinning only steals the GIL
            spin_us = 0.0 if os.environ.get("TRITON_INTERPRET") == "1" else 200.0
        self.spin_s = spin_us * 1e-6
        self.max_sleep_s = max_sleep_us * 1e-6
        self.pool_workers = pool_workers
        self.served = 0
        self.errors = 0
        self._count_lock = threading.Lock()
        self._fence_lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._inflight = 0
        for name, fn in (functions or {}).items():
            self.register_function(name, fn)

    def register_function(self, name: str, fn: Callable | H.HostFunction, *, inline: bool = False,
                          vectorized: bool = False) -> int:
        """Make `fn` callable from device code as std.call(port, <the returned id>, ...)."""
        from warploop.std import strings

        if not isinstance(fn, H.HostFunction):
            fn = H.HostFunction(fn, inline=inline, vectorized=vectorized)
        fid = strings.intern(name)
        self.handlers.register(fid, fn)
        return fid

    def watch(self, ports: int) -> None:
        """Scan only the first `ports` ports (the ones callers own), when fewer than were allocated."""
        if not 1 <= ports <= len(self._words):
            raise ValueError(f"watch({ports}): there are {len(self._words)} ports")
        self._state = self._words[:ports, _STATE]

    @property
    def files(self) -> FileTable:
        return self.handlers.files

    @property
    def buffers(self) -> Buffers:
        return self.handlers.buffers

    def start(self) -> HostServer:
        if self._thread is not None:
            raise RuntimeError("this server is already running")
        self._stopping = False
        self._pool = concurrent.futures.ThreadPoolExecutor(self.pool_workers, thread_name_prefix="warploop-std")
        self._thread = threading.Thread(target=self._loop, name="warploop-std-server", daemon=True)
        _servers.add(self)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving; first answer everything already posted (async prints included)."""
        if self._thread is None:
            return
        self._stopping = True
        self.notify()
        self._thread.join()
        self._pool.shutdown(wait=True)
        self._pool = None   # from here on serve_once does pooled work itself
        for _ in range(3):   # one pass takes everything posted; a kernel still running may post more
            if not self.serve_once():
                break
        _servers.discard(self)
        self._thread = None
        self.files.close_all()

    def __enter__(self) -> HostServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def notify(self) -> None:
        self._wake.set()

    def _loop(self) -> None:
        idle_since, sleep = None, 50e-6
        while not self._stopping:
            try:
                busy = self.serve_once()
            except Exception:   # a bug here must not leave every caller spinning forever
                log.exception("host server pass failed; serving on")
                busy = 0
            if busy:
                idle_since, sleep = None, 50e-6
                continue
            now = time.perf_counter()
            idle_since = idle_since or now
            if now - idle_since < self.spin_s:
                if self._inflight:
                    time.sleep(0)   # let pool threads take the GIL
                continue
            if self._wake.wait(sleep):
                idle_since, sleep = None, 50e-6
            else:
                sleep = min(sleep * 2, self.max_sleep_s)
            self._wake.clear()

    def serve_once(self) -> int:
        """One pass: take and answer (or hand to the pool) every posted request; how many."""
        posted = np.flatnonzero(self._state == _POSTED)
        if posted.size == 0:
            return 0
        w = self._words
        if posted.size == 1:   # the common case of a waiting caller: scalar reads and writes only
            port = int(posted[0])
            row = w[port].tolist()
            if not (row[_OPCODE] == _CALL and row[_CALL_ID] in self.handlers.vectorized_ids):
                w[port, _STATE] = _TAKEN
                self._serve_rows([port], [row])
                return 1
        block = w[posted]
        w[posted, _STATE] = _TAKEN
        rest = self._serve_vectorized(posted, block)
        self._serve_rows(posted[rest].tolist(), block[rest].tolist())
        return len(posted)

    def _serve_rows(self, ports: list[int], rows: list[list[int]]) -> None:
        done: list[tuple[int, list[int], int, int]] = []   # (port, row, status, result word)
        lines: list[str] = []
        for port, row in zip(ports, rows, strict=True):
            op, call_id = row[_OPCODE], row[_CALL_ID]
            try:
                if op == _PRINT:
                    lines.append(H.format_line(call_id, _decode_args(row)))
                    done.append((port, row, Status.OK, 0))
                    continue
                fn = self.handlers.function(call_id) if op == _CALL else None
                if self._pool is not None and (op in (_READ, _WRITE) or
                                               (fn is not None and not fn.on_server_thread)):
                    self._submit(port, row)
                else:
                    value, status = self.handlers.run(op, call_id, _decode_args(row))
                    self._note_short_read(port, row, status)
                    done.append((port, row, status, _encode(value, row[_FLAGS])))
            except StdError as e:
                done.append((port, row, *self._fail(port, row, e)))
        if lines:
            self._write_lines(lines)
        if len(done) == 1:
            self._reply_one(*done[0])
        elif done:
            self._reply(np.array([d[0] for d in done]), np.array([d[3] for d in done], dtype=np.int64),
                        np.array([int(d[2]) for d in done]), [d[1][_THEN] for d in done])

    def _write_lines(self, lines: list[str]) -> None:
        out = self.out if self.out is not None else sys.stdout
        out.write("".join(lines))
        out.flush()   # before the reply: once the device moves on, its line is out

    def _serve_vectorized(self, posted, block):
        """Answer the calls to vectorized functions with numpy, no Python per call; the mask of
        the requests left for the general path."""
        rest = np.ones(len(posted), dtype=bool)
        calls = block[:, _OPCODE] == _CALL
        if not self.handlers.vectorized_ids or not calls.any():
            return rest
        for fid in np.unique(block[calls, _CALL_ID]).tolist():
            fn = self.handlers.functions.get(fid)
            if fn is None or not fn.vectorized:
                continue
            sel = calls & (block[:, _CALL_ID] == fid)
            rest &= ~sel
            group, ports = block[sel], posted[sel]
            flags = group[:, _FLAGS]
            try:
                columns = []
                for i in range(int(flags.max()) & ARGC_MASK):
                    col = group[:, _PAYLOAD + i]
                    is_float = (flags >> (FLOAT_MASK_SHIFT + i)) & 1 == 1
                    columns.append(col.view(np.float64) if is_float.all() else
                                   np.where(is_float, col.view(np.float64), col) if is_float.any() else col)
                values = np.broadcast_to(np.asarray(fn.fn(*columns)), (len(ports),))
                words = np.where(flags & WANT_FLOAT_BIT != 0, values.astype(np.float64).view(np.int64),
                                 values.astype(np.int64))
                status = np.zeros(len(ports), dtype=np.int64)
            except Exception as e:   # one log line for the group, an error status for every caller
                err = e if isinstance(e, StdError) else StdError(
                    Status.CALLBACK_ERROR, f"vectorized host function raised {type(e).__name__}: {e}")
                st, word = self._fail(int(ports[0]), group[0].tolist(), err, count=len(ports))
                words, status = np.full(len(ports), word), np.full(len(ports), st)
            self._reply(ports, words, status, group[:, _THEN].tolist())
        return rest

    def _reply(self, ports, words, status, thens: list[int]) -> None:
        w = self._words
        w[ports, _RESULT] = words
        w[ports, _STATUS] = status
        w[ports, _SEQ] += 1
        self._fence()
        w[ports, _STATE] = _DONE
        with self._count_lock:
            self.served += len(ports)
        if self.on_reply is not None:
            for port, then, st, word in zip(ports.tolist(), thens, status.tolist(), words.tolist(), strict=True):
                if then:
                    self.on_reply(port, then, st, word)

    def _reply_one(self, port: int, row: list[int], status: int, result: int) -> None:
        w = self._words
        w[port, _RESULT] = result
        w[port, _STATUS] = int(status)
        w[port, _SEQ] = row[_SEQ] + 1
        self._fence()
        w[port, _STATE] = _DONE
        with self._count_lock:
            self.served += 1
        if self.on_reply is not None and row[_THEN]:
            self.on_reply(port, row[_THEN], int(status), result)

    def _submit(self, port: int, row: list[int]) -> None:
        with self._count_lock:
            self._inflight += 1
        self._pool.submit(self._run_pooled, port, row)

    def _run_pooled(self, port: int, row: list[int]) -> None:
        try:
            value, status = self.handlers.run(row[_OPCODE], row[_CALL_ID], _decode_args(row))
            self._note_short_read(port, row, status)
            self._reply_one(port, row, status, _encode(value, row[_FLAGS]))
        except StdError as e:
            self._reply_one(port, row, *self._fail(port, row, e))
        except Exception as e:   # e.g. a CUDA error in a copy: the caller still gets an answer
            self._reply_one(port, row, *self._fail(port, row, StdError(Status.IO_ERROR, repr(e))))
        finally:
            with self._count_lock:
                self._inflight -= 1

    def _fail(self, port: int, row: list[int], err: StdError, count: int = 1) -> tuple[int, int]:
        """Log a refused request; its (status, result word): a call's result is 0 (any value is a
        valid result), every other request's is minus the status, so device code tests `< 0`."""
        with self._count_lock:
            self.errors += count
        opname = Opcode(row[_OPCODE]).name if row[_OPCODE] in Opcode._value2member_map_ else row[_OPCODE]
        log.warning("%s from worker %d (port %d, %s%s): %s", err.status.name, row[_WORKER], port, opname,
                    f", and {count - 1} more callers" if count > 1 else "", err,
                    exc_info=err.status == Status.CALLBACK_ERROR and err.__cause__ is not None)
        return int(err.status), 0 if row[_OPCODE] == _CALL else -int(err.status)

    def _note_short_read(self, port: int, row: list[int], status: int) -> None:
        # Reading to the end of a file is how device code finds the end: logged, but not as a warning.
        if status == Status.SHORT_READ:
            log.info("SHORT_READ from worker %d (port %d): fd %d, asked %d bytes", row[_WORKER], port,
                     row[_PAYLOAD], row[_PAYLOAD + 2])

    def _fence(self) -> None:
        """A full memory barrier (taking a lock is one), so the reply's words are visible before DONE
        on hosts that reorder stores (Arm); on x86 stores are already ordered."""
        with self._fence_lock:
            pass
