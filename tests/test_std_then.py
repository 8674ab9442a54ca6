"""Async host calls that resume a continuation: a task posts a call with then=std.token(h) for an
external handle h (wl.external), attaches `wl.then(ctx, h, ...)` and returns; the std server's reply
completes h through the runtime's submit ring, and the continuation reads the reply with
wl.result/wl.status. On the CPU executor and, when there is one, on the GPU's resident kernel."""
from __future__ import annotations

import io
import threading
import time

import pytest
import torch
import triton
import triton.language as tl

import warploop
from warploop.runtime import device as wl
from warploop.runtime.errors import ERR_BAD_HANDLE
from warploop.std import HostCalls, intern
from warploop.std import device as std
from warploop.std.protocol import Status

FN = intern("test_std_then.square")
FMT = intern("then %d")
PATH_R = intern("in.bin")
PATH_W = intern("out.bin")
STRIDE = 4      # per record: result, status, times resumed, host time when the continuation ran
RECORD = tl.constexpr(STRIDE)   # the same, for device code
FAILING = 5     # the host function raises for this argument

DEVICES = [pytest.param("cuda", marks=pytest.mark.gpu)] if torch.cuda.is_available() else ["cpu"]


@warploop.task(signature={"out": "*i64", "h": "i64", "i": "i32"})
@triton.jit
def record(ctx, out, h, i):
    rec = out + i * RECORD
    tl.store(rec + 0, wl.result(ctx, h))
    tl.store(rec + 1, wl.status(ctx, h).to(tl.int64))
    tl.atomic_add(rec + 2, 1)
    tl.store(rec + 3, std.time(std.task_port(ctx)))


@warploop.task(signature={"out": "*i64", "i": "i32"}, constexprs={"FN": FN})
@triton.jit
def caller(ctx, out, i, FN: tl.constexpr):
    h = wl.external(ctx)
    std.call_async(std.task_port(ctx, 1), FN, i, then=std.token(h))
    wl.then(ctx, h, record, out, h, i)


@triton.jit
def _resume_into(ctx, out, i, h):
    wl.then(ctx, h, record, out, h, i)


@warploop.task(signature={"out": "*i64"}, constexprs={"FMT": FMT, "FN": FN, "PATH_R": PATH_R, "PATH_W": PATH_W})
@triton.jit
def every_kind(ctx, out, FMT: tl.constexpr, FN: tl.constexpr, PATH_R: tl.constexpr, PATH_W: tl.constexpr):
    # One port for all: each post waits for the port's previous call to be answered.
    p = std.task_port(ctx, 1)
    h = wl.external(ctx)
    std.print_async(p, FMT, 7, then=std.token(h))
    _resume_into(ctx, out, 0, h)
    h = wl.external(ctx)
    std.time_async(p, then=std.token(h))
    _resume_into(ctx, out, 1, h)
    h = wl.external(ctx)
    std.call_async(p, FN, 9, then=std.token(h))
    _resume_into(ctx, out, 2, h)
    h = wl.external(ctx)
    std.open_async(p, PATH_R, std.O_READ, then=std.token(h))
    _resume_into(ctx, out, 3, h)
    h = wl.external(ctx)
    std.open_async(p, PATH_W, std.O_WRITE, then=std.token(h))
    _resume_into(ctx, out, 4, h)


@warploop.task(signature={"out": "*i64", "buf": "*u8", "fdr": "i64", "fdw": "i64"})
@triton.jit
def file_kinds(ctx, out, buf, fdr, fdw):
    p = std.task_port(ctx, 1)
    h = wl.external(ctx)
    std.read_async(p, fdr, buf, 16, 0, then=std.token(h))
    _resume_into(ctx, out, 5, h)
    h = wl.external(ctx)
    std.write_async(p, fdw, buf, 16, then=std.token(h))
    _resume_into(ctx, out, 6, h)
    h = wl.external(ctx)
    std.close_async(p, fdr, then=std.token(h))
    _resume_into(ctx, out, 7, h)
    h = wl.external(ctx)
    std.close_async(p, fdw, then=std.token(h))
    _resume_into(ctx, out, 8, h)


class Square:
    """The host function: i * i after a short sleep for some i, stamped with the wall clock."""

    def __init__(self) -> None:
        self.stamps: dict[int, int] = {}
        self.lock = threading.Lock()

    def __call__(self, i: int) -> int:
        if i == FAILING:
            raise ValueError("the failing argument")
        if i % 8 == 1:
            time.sleep(0.02)   # the caller has long returned: its continuation must still wait
        with self.lock:
            self.stamps[i] = time.time_ns()
        return i * i


def _runtime(calls: HostCalls, device: str, tasks, workers: int | None, pool: int = 4096, submit_slots: int = 256):
    return warploop.Runtime(device=device, tasks=tasks, workers=workers, pool=pool, ports=calls.ports,
                            submit_slots=submit_slots, timeout=30)


@pytest.mark.parametrize("device", DEVICES)
def test_continuations_resume_once_after_their_reply(device):
    n = 24 if device == "cpu" else 2000
    square = Square()
    out = torch.zeros(n * STRIDE, dtype=torch.int64, device=device)
    calls = HostCalls(device=device, functions={"test_std_then.square": square})
    workers = 4 if device == "cpu" else None
    # More callers than submit slots: the replies' completions must get through a ring whose other
    # slots wait on exactly those completions.
    slots = 8 if device == "cpu" else 256
    with calls, _runtime(calls, device, [caller, record], workers, pool=16384, submit_slots=slots) as rt:
        calls.bind(rt)
        futures = [rt.submit(caller, out, i) for i in range(n)]
        for f in futures:   # a caller's handle completes once its continuation has
            f.result(timeout=120)
        assert calls.server.errors == 1
    r = out.cpu().view(n, STRIDE)
    ok = [i for i in range(n) if i != FAILING]
    assert r[ok, 0].tolist() == [i * i for i in ok]
    assert r[ok, 1].tolist() == [0] * len(ok)
    assert r[FAILING, :2].tolist() == [0, int(Status.CALLBACK_ERROR)]   # the error reaches the continuation
    assert r[:, 2].tolist() == [1] * n                                  # each resumed exactly once
    assert all(r[i, 3] >= square.stamps[i] for i in ok)                 # never before the reply


@pytest.mark.parametrize("device", DEVICES)
def test_every_call_kind_resumes(device, tmp_path):
    (tmp_path / "in.bin").write_bytes(bytes(range(100, 132)))
    sink = io.StringIO()
    out = torch.zeros(9 * STRIDE, dtype=torch.int64, device=device)
    buf = torch.zeros(16, dtype=torch.uint8, device=device)
    calls = HostCalls(files_root=tmp_path, device=device, out=sink, functions={"test_std_then.square": Square()})
    calls.register_buffer(buf)
    # The server starts late: the task's second post must wait for the first to be answered
    # (posting over a request the server has not taken would lose it, and a continuation).
    late = threading.Timer(0.3, calls.start)
    try:
        with _runtime(calls, device, [every_kind, file_kinds, record], 2 if device == "cpu" else None) as rt:
            calls.bind(rt)
            t0 = time.time_ns()
            late.start()
            rt.submit(every_kind, out).result(timeout=20)
            r = out.cpu().view(9, STRIDE)
            fdr, fdw = int(r[3, 0]), int(r[4, 0])
            assert fdr >= 0 and fdw >= 0 and fdr != fdw
            rt.submit(file_kinds, out, buf, fdr, fdw).result(timeout=20)
    finally:
        late.cancel()
        if late.ident is not None:
            late.join()
        calls.close()
    r = out.cpu().view(9, STRIDE)
    assert r[:, 2].tolist() == [1] * 9
    assert r[:, 1].tolist() == [0] * 9
    assert r[0, 0] == 0 and sink.getvalue() == "then 7\n"            # print
    assert t0 <= r[1, 0] <= time.time_ns()                            # time
    assert r[2, 0] == 81                                              # call
    assert r[5:, 0].tolist() == [16, 16, 0, 0]                        # read, write, close, close
    assert buf.cpu().tolist() == list(range(100, 116))
    assert (tmp_path / "out.bin").read_bytes() == bytes(range(100, 116))
    assert calls.server.errors == 0


@pytest.mark.parametrize("handle", [1, 0, 10**6], ids=["completed-already", "a-task", "never-issued"])
def test_a_bad_completion_is_refused_and_the_runtime_goes_on(handle):
    calls = HostCalls(device="cpu", functions={"test_std_then.square": Square()})
    out = torch.zeros(4 * STRIDE, dtype=torch.int64)
    with calls, _runtime(calls, "cpu", [caller, record], 2) as rt:
        calls.bind(rt)
        rt.submit(caller, out, 2).result(timeout=30)     # task 0: caller, 1: its handle, 2: record
        rt.complete_external(handle, 0, 5)
        rt.submit(caller, out, 3).result(timeout=30)     # taken after the bad request
        error = rt.status().error
    assert error["code"] == ERR_BAD_HANDLE and not error["fatal"]
    assert out.view(4, STRIDE)[2:, :3].tolist() == [[4, 0, 1], [9, 0, 1]]   # each resumed once


def test_resident_kernel_with_continuations_compiles_for_cuda():
    """No GPU needed: what the interpreter accepts but the compiler refuses (a global that is not a
    constexpr, say) fails here, not on the device."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from warploop.runtime import codegen
    from warploop.runtime.tasks import lookup

    module = codegen.build([lookup(t) for t in (caller, record)])
    src = ASTSource(fn=module.resident, signature={"arena": "*i32"},
                    constexprs={"INLINE": False, "TRACE": False, "BACKEND": "cuda"})
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
    assert "atom.global.sys.release.exch.b64" in ptx      # posts to a port
