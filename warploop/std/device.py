"""The standard library on the device: Triton functions a task calls to reach the host.

Every call takes the caller's `port` (a pointer to its mailbox, `port(ports, index)`): the runtime
gives each worker its own, so calls never wait for another caller. Scalars are int64 or float64 on
the wire (at most 7 per call); strings are ids from `warploop.std.intern` (formats, paths, function
names). Synchronous calls return the host's reply; each has an `_async` form that posts and returns
at once: `poll(port)` says whether the reply is in, `wait(port)` returns it, and a nonzero `then`
token is handed to the host server's on_reply hook, which is how the runtime resumes a continuation:
`then=token(h)` for an external handle `h = wl.external(ctx)` completes h with the reply, and
`wl.then(ctx, h, task, ...)` runs task after it (HostCalls.bind; docs/std.md). A port carries one
call at a time: a post with a `then` token waits for the port's previous reply; otherwise wait for
the reply before posting again.

    @triton.jit
    def kernel(ports, data, FMT: tl.constexpr, SQUARE: tl.constexpr):
        p = std.port(ports, tl.program_id(0))
        t0 = std.clock()
        y = std.call(p, SQUARE, 7)                  # 49, computed by a host Python function
        std.print(p, FMT, y, std.clock() - t0)      # FMT = std.intern("y=%d in %d ns")

Errors: file calls and time return the fd or byte count, or minus the Status (protocol.py) on
failure; `call` returns 0 on failure. `status(port)` gives the Status of the last reply either way.
The memory ordering is in docs/std.md; this file only follows it.
"""
from __future__ import annotations

import time as _time

import triton
import triton.language as tl

from warploop.runtime import device as wl
from warploop.std.protocol import (
    FLOAT_MASK_SHIFT,
    PORT_WORDS,
    SLOTS_PER_WORKER,
    WANT_FLOAT_BIT,
    Opcode,
    OpenMode,
    State,
    Word,
)

_WORDS = tl.constexpr(PORT_WORDS)
_SLOTS = tl.constexpr(SLOTS_PER_WORKER)
_STATE = tl.constexpr(int(Word.STATE))
_RESULT = tl.constexpr(int(Word.RESULT))
_STATUS = tl.constexpr(int(Word.STATUS))
_SEQ = tl.constexpr(int(Word.SEQ))
_OPCODE = tl.constexpr(int(Word.OPCODE))
_CALL_ID = tl.constexpr(int(Word.CALL_ID))
_FLAGS = tl.constexpr(int(Word.FLAGS))
_THEN = tl.constexpr(int(Word.THEN))
_PAYLOAD = tl.constexpr(int(Word.PAYLOAD))
_POSTED = tl.constexpr(int(State.POSTED))
_TAKEN = tl.constexpr(int(State.TAKEN))
_DONE = tl.constexpr(int(State.DONE))
_FSHIFT = tl.constexpr(FLOAT_MASK_SHIFT)
_WANT_FLOAT = tl.constexpr(WANT_FLOAT_BIT)
_PRINT = tl.constexpr(int(Opcode.PRINT))
_TIME = tl.constexpr(int(Opcode.TIME))
_OPEN = tl.constexpr(int(Opcode.OPEN))
_READ = tl.constexpr(int(Opcode.READ))
_WRITE = tl.constexpr(int(Opcode.WRITE))
_CLOSE = tl.constexpr(int(Opcode.CLOSE))
_CALL = tl.constexpr(int(Opcode.CALL))

O_READ = tl.constexpr(int(OpenMode.READ))
O_WRITE = tl.constexpr(int(OpenMode.WRITE))
O_APPEND = tl.constexpr(int(OpenMode.APPEND))


def _builtin(fn):
    """Mark fn as a Triton builtin. The compiler calls it with `_semantic`; the interpreter, which
    runs device code as Python in this process, calls it without one."""
    fn.__triton_builtin__ = True
    return fn


@_builtin
def _ring(_semantic=None):
    # Interpreter only: the "device" is a thread here, so it can wake the servers. A GPU cannot;
    # the server's timed re-scan is its doorbell.
    if _semantic is None:
        from warploop.std.server import ring_doorbells
        ring_doorbells()


@_builtin
def _relax(_semantic=None):
    # Interpreter only: give the server thread the GIL while this "device" waits for it.
    if _semantic is None:
        _time.sleep(0)


@_builtin
def _scalar(x, _semantic=None):
    """Python numbers and constexprs as tensors, so their dtype can be asked."""
    if _semantic is None:
        from triton.runtime.interpreter import interpreter_semantic as _semantic
    return _semantic.to_tensor(x)


@_builtin
def clock(_semantic=None):
    """Device time in ns, read on the device (no host trip): %globaltimer on NVIDIA, s_memrealtime
    (100 MHz) on AMD, the host's monotonic clock under the interpreter."""
    if _semantic is None:
        return tl.full((), _time.monotonic_ns(), tl.int64)
    backend = _semantic.builder.options.backend_name
    if backend == "cuda":
        return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False,
                                         pack=1, _semantic=_semantic)
    if backend == "hip":
        from triton.language.extra.hip import memrealtime
        return memrealtime(_semantic=_semantic).__mul__(10, _semantic=_semantic)
    raise NotImplementedError(f"std.clock() has no timer for the {backend} backend")


@triton.jit
def port(ports, index):
    """The port of caller `index` in the port array `ports` (int64 pointer, PORT_WORDS per port)."""
    return ports + index * _WORDS


@triton.jit
def task_port(ctx, slot=0):
    """In a runtime task: this worker's port `slot` (0: synchronous calls; 1: one async call in flight),
    from the port array given as Runtime(ports=HostCalls(...).ports)."""
    return port(wl.ports(ctx), wl.worker_id(ctx) * _SLOTS + slot)


@triton.jit
def _word(x):
    x = _scalar(x)
    if x.dtype.is_floating():
        w = x.to(tl.float64).to(tl.int64, bitcast=True)
    else:
        w = x.to(tl.int64)
    return w


@triton.jit
def _float_bit(x):
    x = _scalar(x)
    if x.dtype.is_floating():
        bit = 1
    else:
        bit = 0
    return bit


@triton.jit
def _put(port, i: tl.constexpr, x, flags):
    # One argument into the payload; flags counts it (argc) and marks it if it is a float.
    if x is not None:
        tl.store(port + _PAYLOAD + i, _word(x))
        flags = flags + 1 + (_float_bit(x) << (_FSHIFT + i))
    return flags


@triton.jit
def _all_warps_wait_for(port, answer):
    # A store that never happens (port words used here are >= 0) but uses an atomic's answer:
    # Triton hands a scalar atomic's result to every thread through shared memory behind a
    # barrier, so no warp goes on until the atomic has been performed in host memory.
    tl.store(port + _STATE, answer, mask=answer < 0)


@triton.jit
def _wait_idle(port):
    # A call posted with a continuation is answered after its caller has moved on, maybe to another
    # task on the same worker and port: a post waits until the port's previous call is answered.
    # STATE only moves POSTED -> TAKEN -> DONE until this caller posts again, so warps agree.
    state = tl.load(port + _STATE, volatile=True)
    while (state == _POSTED) | (state == _TAKEN):
        _relax()
        state = tl.load(port + _STATE, volatile=True)


@triton.jit
def _post(port, opcode, call_id, flags, then, a0, a1, a2, a3, a4, a5, a6):
    # A program's warps are not in step, and only one thread writes the port. The barrier keeps
    # this post from overtaking a warp still reading the previous reply; waiting for the exchange's
    # answer below keeps any warp from polling before POSTED has replaced that reply's DONE.
    if then != 0:
        _wait_idle(port)
    tl.debug_barrier()
    flags = _put(port, 0, a0, flags)
    flags = _put(port, 1, a1, flags)
    flags = _put(port, 2, a2, flags)
    flags = _put(port, 3, a3, flags)
    flags = _put(port, 4, a4, flags)
    flags = _put(port, 5, a5, flags)
    flags = _put(port, 6, a6, flags)
    tl.store(port + _OPCODE, opcode)
    tl.store(port + _CALL_ID, call_id)
    tl.store(port + _FLAGS, flags)
    tl.store(port + _THEN, then)
    # Release at system scope: the host sees every word above before it sees POSTED.
    _all_warps_wait_for(port, tl.atomic_xchg(port + _STATE, _POSTED, sem="release", scope="sys"))
    _ring()


@triton.jit
def token(handle):
    """The `then=` token of an async call whose reply completes runtime handle `handle`
    (wl.external): its continuations read the reply with wl.result(ctx, handle) and wl.status."""
    return handle + 1


@triton.jit
def poll(port):
    """1 if the reply to the port's call has arrived (then `wait` returns at once), else 0."""
    return (tl.load(port + _STATE, volatile=True) == _DONE).to(tl.int32)


@triton.jit
def wait(port):
    """Spin until the reply arrives; its result word (int64)."""
    # STATE and RESULT in one 16-byte load: the host writes RESULT before STATE, so a load that
    # sees DONE carries the reply's RESULT with it.
    offs = tl.arange(0, 2)
    reply = tl.load(port + _STATE + offs, volatile=True)
    while tl.sum(tl.where(offs == 0, reply, 0)) != _DONE:
        _relax()
        reply = tl.load(port + _STATE + offs, volatile=True)
    return tl.sum(tl.where(offs == 1, reply, 0))


@triton.jit
def wait_float(port):
    """`wait` for a call that asked for a float result (call_float, call_async(want_float=True))."""
    return wait(port).to(tl.float64, bitcast=True)


@triton.jit
def status(port):
    """The Status of the port's last reply (0 = OK); read it after the reply arrived."""
    return tl.load(port + _STATUS, volatile=True)


@triton.jit
def _acquire(port):
    # After a READ the host's copy engine wrote the caller's buffer: an acquire at system scope,
    # which every warp waits for, orders the program's next loads after it (no stale L1 lines).
    _all_warps_wait_for(port, tl.atomic_or(port + _SEQ, 0, sem="acquire", scope="sys"))


@triton.jit
def print_async(port, fmt_id, a0=None, a1=None, a2=None, a3=None, a4=None, a5=None, a6=None, then=0):
    _post(port, _PRINT, fmt_id, 0, then, a0, a1, a2, a3, a4, a5, a6)


@triton.jit
def print(port, fmt_id, a0=None, a1=None, a2=None, a3=None, a4=None, a5=None, a6=None):
    """Print one line: the registered format `fmt_id` %-formatted with the scalars, on the host.
    Returns once the line is written and flushed, so it survives a later failure of the program."""
    _post(port, _PRINT, fmt_id, 0, 0, a0, a1, a2, a3, a4, a5, a6)
    return wait(port)


@triton.jit
def time_async(port, then=0):
    _post(port, _TIME, 0, 0, then, None, None, None, None, None, None, None)


@triton.jit
def time(port):
    """The host's wall clock, ns since the Unix epoch."""
    time_async(port)
    return wait(port)


@triton.jit
def open_async(port, path_id, mode, then=0):
    _post(port, _OPEN, path_id, 0, then, mode, None, None, None, None, None, None)


@triton.jit
def open(port, path_id, mode):
    """Open the interned path `path_id` (relative to the runtime's files root) with O_READ, O_WRITE
    or O_APPEND; an fd, or a negative Status."""
    open_async(port, path_id, mode)
    return wait(port)


@triton.jit
def read_async(port, fd, ptr, nbytes, offset, then=0):
    _post(port, _READ, 0, 0, then, fd, ptr.to(tl.int64), nbytes, offset, None, None, None)


@triton.jit
def read(port, fd, ptr, nbytes, offset):
    """Read up to `nbytes` at file `offset` into device memory at `ptr` (inside a registered buffer).
    The number of bytes read (fewer at the end of the file: status SHORT_READ), or a negative Status."""
    read_async(port, fd, ptr, nbytes, offset)
    got = wait(port)
    _acquire(port)
    return got


@triton.jit
def write_async(port, fd, ptr, nbytes, then=0):
    _post(port, _WRITE, 0, 0, then, fd, ptr.to(tl.int64), nbytes, None, None, None, None)


@triton.jit
def write(port, fd, ptr, nbytes):
    """Write `nbytes` of device memory at `ptr` to the file; the count, or a negative Status."""
    write_async(port, fd, ptr, nbytes)
    return wait(port)


@triton.jit
def close_async(port, fd, then=0):
    _post(port, _CLOSE, 0, 0, then, fd, None, None, None, None, None, None)


@triton.jit
def close(port, fd):
    """Close an fd; 0, or a negative Status."""
    close_async(port, fd)
    return wait(port)


@triton.jit
def call_async(port, fn_id, a0=None, a1=None, a2=None, a3=None, a4=None, a5=None, a6=None, then=0,
               want_float: tl.constexpr = False):
    if want_float:
        _post(port, _CALL, fn_id, _WANT_FLOAT, then, a0, a1, a2, a3, a4, a5, a6)
    else:
        _post(port, _CALL, fn_id, 0, then, a0, a1, a2, a3, a4, a5, a6)


@triton.jit
def call(port, fn_id, a0=None, a1=None, a2=None, a3=None, a4=None, a5=None, a6=None):
    """Call the host function registered under `fn_id`; its result as int64 (0 and a nonzero
    status(port) if it raised or is unknown)."""
    call_async(port, fn_id, a0, a1, a2, a3, a4, a5, a6)
    return wait(port)


@triton.jit
def call_float(port, fn_id, a0=None, a1=None, a2=None, a3=None, a4=None, a5=None, a6=None):
    """`call` for a host function whose result is wanted as float64."""
    call_async(port, fn_id, a0, a1, a2, a3, a4, a5, a6, want_float=True)
    return wait_float(port)
