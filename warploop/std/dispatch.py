"""One pass of the host server: take every posted request and answer it (or hand it on).

All POSTED requests of a pass are answered together: prints are formatted and written with one
write and one flush, calls to vectorized functions get one numpy call per function, quick requests
(time, open, close, inline functions) are done here and replied to with a few numpy stores, and
slow ones (host functions by default, file reads and writes) go to the thread pool, which replies
when each is done, so one slow callback never holds up the others. A lone request, the usual case
of one waiting caller, is read and answered with scalar accesses only. Every request gets a reply,
whatever fails: an error becomes a status for its caller and a log line.
"""
from __future__ import annotations

import concurrent.futures
import logging
import sys
import threading
from collections.abc import Callable

import numpy as np

from warploop.std import handlers as H
from warploop.std.protocol import (
    ARGC_MASK,
    FLOAT_MASK_SHIFT,
    PAYLOAD_WORDS,
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

# on_reply(port, then, status, result_word): called after an async request with a continuation
# token has been answered, so the runtime can resume that continuation.
ReplyHook = Callable[[int, int, int, int], None]

# The hot path indexes with plain ints: an IntEnum member lookup costs as much as a numpy store.
_STATE, _RESULT, _STATUS, _SEQ, _OPCODE, _CALL_ID, _WORKER, _FLAGS, _THEN, _PAYLOAD = (int(w) for w in Word)
_POSTED, _TAKEN, _DONE = int(State.POSTED), int(State.TAKEN), int(State.DONE)
_PRINT, _CALL, _READ, _WRITE = int(Opcode.PRINT), int(Opcode.CALL), int(Opcode.READ), int(Opcode.WRITE)
_FLOAT_MASK = (1 << PAYLOAD_WORDS) - 1


def _decode_args(row: list[int]) -> list:
    flags = row[_FLAGS]
    payload = row[_PAYLOAD:_PAYLOAD + (flags & ARGC_MASK)]
    mask = flags >> FLOAT_MASK_SHIFT & _FLOAT_MASK
    if not mask:   # no float argument (a no-op call has none at all): the words as they are
        return payload
    return [word_to_float(w) if mask >> i & 1 else w for i, w in enumerate(payload)]


def unexpected(e: Exception) -> StdError:
    """Any other exception from a request, as the status its caller gets: whatever a handler raises,
    the port is answered (a NUL byte in a path is a ValueError, a failing open an OSError)."""
    status = Status.BAD_ARGUMENT if isinstance(e, (ValueError, TypeError)) else Status.IO_ERROR
    err = StdError(status, f"{type(e).__name__}: {e}")
    err.__cause__ = e
    return err


def _encode(value, flags: int) -> int:
    if flags & WANT_FLOAT_BIT:
        try:
            return float_to_word(0.0 if value is None else value)
        except (TypeError, ValueError, OverflowError) as e:
            raise StdError(Status.CALLBACK_ERROR, f"returned {value!r}, which is not a float") from e
    return H.check_int64(value)


class Dispatcher:
    """Answers the requests posted in `words` (the numpy view of the ports); HostServer runs it."""

    def __init__(self, words: np.ndarray, handlers: H.Handlers, out, on_reply: ReplyHook | None) -> None:
        self._words = words
        self._state = words[:, _STATE]
        self.handlers = handlers
        self.out = out
        self.on_reply = on_reply
        self.served = 0
        self.errors = 0
        self._count_lock = threading.Lock()
        self._fence_lock = threading.Lock()
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None   # None: pooled work is done inline
        self._inflight = 0

    def serve_once(self) -> int:
        """One pass: take and answer (or hand to the pool) every posted request; how many."""
        # Every state is 0-3, so in the little-endian bytes of the STATE words a 0x01 byte is the
        # low byte of a POSTED word and nothing else: one strided copy and a memchr find whether
        # anything, and whether exactly one thing, is posted (a numpy compare costs ~10x more).
        snap = self._state.tobytes()
        first = snap.find(b"\x01")
        if first < 0:
            return 0
        w = self._words
        if first & 7 == 0 and snap.find(b"\x01", first + 8) < 0:   # a lone request: scalar path
            port = first >> 3
            row = w[port].tolist()
            if row[_OPCODE] == _CALL:
                fn = self.handlers.functions.get(row[_CALL_ID])
                if fn is not None and fn.inline and not fn.vectorized:
                    self._call_inline(port, row, fn)
                    return 1
            if not (row[_OPCODE] == _CALL and row[_CALL_ID] in self.handlers.vectorized_ids):
                w[port, _STATE] = _TAKEN
                self._serve_rows([port], [row])
                return 1
        posted = np.flatnonzero(np.frombuffer(snap, dtype=np.int64) == _POSTED)
        if posted.size == 0:
            return 0
        block = w[posted]
        w[posted, _STATE] = _TAKEN
        rest = self._serve_vectorized(posted, block)
        self._serve_rows(posted[rest].tolist(), block[rest].tolist())
        return len(posted)

    def _call_inline(self, port: int, row: list[int], fn: H.HostFunction) -> None:
        """A lone call to an inline function, answered straight away: the round-trip latency path
        (no TAKEN store, lists or hand-offs; the same statuses as handlers.run)."""
        try:
            try:
                value = fn.fn(*_decode_args(row))
            except StdError:
                raise
            except Exception as e:
                raise StdError(Status.CALLBACK_ERROR, f"host function raised {type(e).__name__}: {e}") from e
            self._reply_one(port, row, 0, _encode(value, row[_FLAGS]))
        except StdError as e:
            self._reply_one(port, row, *self._fail(port, row, e))

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
            except Exception as e:   # a bug or a case no handler foresaw: still an answer, never TAKEN forever
                done.append((port, row, *self._fail(port, row, unexpected(e))))
        if lines and not self._write_lines(lines):
            done = [(p, r, Status.IO_ERROR, -int(Status.IO_ERROR)) if r[_OPCODE] == _PRINT else (p, r, st, v)
                    for p, r, st, v in done]
        if len(done) == 1:
            self._reply_one(*done[0])
        elif done:
            self._reply(np.array([d[0] for d in done]), np.array([d[3] for d in done], dtype=np.int64),
                        np.array([int(d[2]) for d in done]), [d[1][_THEN] for d in done])

    def _write_lines(self, lines: list[str]) -> bool:
        out = self.out if self.out is not None else sys.stdout
        try:
            out.write("".join(lines))
            out.flush()   # before the reply: once the device moves on, its line is out
            return True
        except Exception as e:   # a closed or broken stream: the callers get IO_ERROR
            with self._count_lock:
                self.errors += len(lines)
            log.warning("IO_ERROR: %d printed lines could not be written: %s", len(lines), e)
            return False

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
                    self._resume(port, then, st, word)

    def _reply_one(self, port: int, row: list[int], status: int, result: int) -> None:
        w = self._words
        w[port, _RESULT] = result
        w[port, _STATUS] = int(status)
        w[port, _SEQ] = row[_SEQ] + 1
        with self._count_lock:   # also the fence (_fence) that puts the words above before DONE
            self.served += 1
        w[port, _STATE] = _DONE
        if self.on_reply is not None and row[_THEN]:
            self._resume(port, row[_THEN], int(status), result)

    def _resume(self, port: int, then: int, status: int, result: int) -> None:
        try:
            self.on_reply(port, then, status, result)
        except Exception:   # the reply is already out; a failing hook must not stop the server
            log.exception("on_reply hook failed for port %d (continuation %d)", port, then)

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
            self._reply_one(port, row, *self._fail(port, row, unexpected(e)))
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
                    exc_info=err.__cause__ is not None and (err.status == Status.CALLBACK_ERROR or
                                                            not isinstance(err.__cause__, (OSError, StdError))))
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
