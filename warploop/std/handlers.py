"""What the host does for each opcode. The server (server.py) decides where and when it runs.

Every handler takes the request's call id and decoded arguments and returns a Python value, or
raises StdError with the status the caller gets. Nothing here knows about ports or threads.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from warploop.std import strings
from warploop.std.files import FileTable
from warploop.std.memory import Buffers
from warploop.std.protocol import Opcode, Status, StdError

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1


@dataclasses.dataclass(frozen=True)
class HostFunction:
    """A host Python function device code may `call`.

    By default it runs on the server's thread pool, so a slow one does not stall other calls.
    inline=True runs it on the server thread itself (no hand-off: the fastest round trip; only for
    functions that return in microseconds). vectorized=True (implies inline) calls it once per
    server pass with one numpy array per argument, holding that argument of every pending call,
    and takes back an array of results: the way to serve every worker calling at once.
    """

    fn: Callable
    inline: bool = False
    vectorized: bool = False
    on_server_thread: bool = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "on_server_thread", self.inline or self.vectorized)


def _text(call_id: int, what: str) -> str:
    text = strings.lookup(call_id)
    if text is None:
        raise StdError(Status.UNKNOWN_ID, f"no {what} is registered under id {call_id}; intern() it on the host")
    return text


def format_line(call_id: int, args: list) -> str:
    """The line a PRINT request prints (Python %-formatting of the registered format)."""
    fmt = _text(call_id, "format string")
    try:
        return (fmt % tuple(args) if args else fmt) + "\n"
    except (TypeError, ValueError) as e:
        raise StdError(Status.BAD_ARGUMENT, f"format {fmt!r} with arguments {args}: {e}") from e


def check_int64(value) -> int:
    """A host function's return value as an int64 word, or StdError(CALLBACK_ERROR)."""
    if type(value) is int and INT64_MIN <= value <= INT64_MAX:
        return value
    if value is None:
        return 0
    try:
        out = int(value)
    except (TypeError, ValueError, OverflowError) as e:
        raise StdError(Status.CALLBACK_ERROR, f"returned {value!r}, which is not a scalar") from e
    if not INT64_MIN <= out <= INT64_MAX:
        raise StdError(Status.CALLBACK_ERROR, f"returned {out}, which does not fit in int64")
    return out


class Handlers:
    def __init__(self, files: FileTable, buffers: Buffers) -> None:
        self.files = files
        self.buffers = buffers
        self.functions: dict[int, HostFunction] = {}
        self.vectorized_ids: set[int] = set()

    def register(self, call_id: int, fn: HostFunction) -> None:
        self.functions[call_id] = fn
        if fn.vectorized:
            self.vectorized_ids.add(call_id)
        else:
            self.vectorized_ids.discard(call_id)

    def function(self, call_id: int) -> HostFunction:
        fn = self.functions.get(call_id)
        if fn is None:
            name = strings.lookup(call_id)
            raise StdError(Status.UNKNOWN_ID, f"no host function is registered under {name or call_id!r}")
        return fn

    def run(self, opcode: int, call_id: int, args: list) -> tuple[object, Status]:
        """Do one request (PRINT is batched by the server and never comes here): (value, status)."""
        if opcode == Opcode.CALL:
            try:
                return self.function(call_id).fn(*args), Status.OK
            except StdError:
                raise
            except Exception as e:
                raise StdError(Status.CALLBACK_ERROR, f"host function raised {type(e).__name__}: {e}") from e
        if opcode == Opcode.TIME:
            return time.time_ns(), Status.OK
        if opcode == Opcode.OPEN:
            return self.files.open(_text(call_id, "path"), *_need(args, 1, "open")), Status.OK
        if opcode == Opcode.READ:
            fd, ptr, nbytes, offset = _need(args, 4, "read")
            got = self.buffers.read_file(self.files, fd, ptr, nbytes, offset)
            return got, (Status.SHORT_READ if got < nbytes else Status.OK)
        if opcode == Opcode.WRITE:
            fd, ptr, nbytes = _need(args, 3, "write")
            return self.buffers.write_file(self.files, fd, ptr, nbytes), Status.OK
        if opcode == Opcode.CLOSE:
            self.files.close(*_need(args, 1, "close"))
            return 0, Status.OK
        raise StdError(Status.UNKNOWN_OPCODE, f"unknown opcode {opcode}")


def _need(args: list, n: int, what: str) -> list[int]:
    if len(args) != n:
        raise StdError(Status.BAD_ARGUMENT, f"{what} takes {n} arguments, got {len(args)}")
    return [int(a) for a in args]
