"""Every device call and its error paths, from real Triton kernels: compiled on a GPU, run by the
Triton interpreter on the CPU, where the kernel spins on its port in this thread while the host
server thread answers it."""
from __future__ import annotations

import io
import logging
import os
import subprocess
import sys
import time

import pytest
import torch
import triton
import triton.language as tl

from warploop.std import FileTable, HostServer, allocate_ports, intern
from warploop.std import device as std
from warploop.std.protocol import Status

ON_GPU = torch.cuda.is_available()
# Triton fixes compiled-or-interpreted when it is imported, so without a GPU these tests run in a
# child process started with TRITON_INTERPRET=1 (test_in_an_interpreter_child).
HERE = ON_GPU or os.environ.get("TRITON_INTERPRET") == "1"
here = pytest.mark.skipif(not HERE, reason="runs in the TRITON_INTERPRET=1 child")
DEVICE = "cuda" if ON_GPU else "cpu"


@pytest.mark.skipif(HERE, reason="this process runs the tests itself")
def test_in_an_interpreter_child():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
                          env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "skipped" in done.stdout


@triton.jit
def calls_kernel(ports, out, FMT: tl.constexpr, MUL: tl.constexpr, HALF: tl.constexpr):
    p = std.port(ports, tl.program_id(0))
    out += tl.program_id(0) * 8
    t0 = std.clock()
    x = std.call(p, MUL, tl.program_id(0) + 1, 3)
    tl.store(out + 0, x)
    tl.store(out + 1, std.call_float(p, HALF, x).to(tl.int64, bitcast=True))
    std.print(p, FMT, x, 0.25)
    tl.store(out + 2, std.time(p))
    t1 = std.clock()
    tl.store(out + 3, t1 - t0)
    tl.store(out + 4, std.status(p))


@triton.jit
def files_kernel(ports, buf, out, READ_PATH: tl.constexpr, WRITE_PATH: tl.constexpr, NBYTES: tl.constexpr):
    p = std.port(ports, 0)
    fd = std.open(p, READ_PATH, std.O_READ)
    tl.store(out + 0, fd)
    got = std.read(p, fd, buf, NBYTES, 2)
    tl.store(out + 1, got)
    tl.store(out + 2, std.status(p))
    offs = tl.arange(0, 8)
    tl.store(buf + offs, tl.load(buf + offs) + 1)       # the device changes what it read ...
    wfd = std.open(p, WRITE_PATH, std.O_WRITE)
    tl.store(out + 3, std.write(p, wfd, buf, 8))         # ... and writes it back out
    tl.store(out + 4, std.close(p, wfd))
    tl.store(out + 5, std.close(p, fd))


@triton.jit
def errors_kernel(ports, buf, out, BOOM: tl.constexpr, UNKNOWN: tl.constexpr, SECRET: tl.constexpr,
                  OK_PATH: tl.constexpr):
    p = std.port(ports, 0)
    tl.store(out + 0, std.call(p, BOOM, 1))
    tl.store(out + 1, std.status(p))
    tl.store(out + 2, std.call(p, UNKNOWN))
    tl.store(out + 3, std.status(p))
    tl.store(out + 4, std.open(p, SECRET, std.O_READ))
    tl.store(out + 5, std.read(p, 1234, buf, 4, 0))
    tl.store(out + 6, std.close(p, 1234))
    fd = std.open(p, OK_PATH, std.O_WRITE)               # refused: the files are read-only
    tl.store(out + 7, fd)
    fd = std.open(p, OK_PATH, std.O_READ)
    tl.store(out + 8, std.read(p, fd, buf + 4096, 4, 0))  # outside every registered buffer
    tl.store(out + 9, std.close(p, fd))


@triton.jit
def async_kernel(ports, out, FN: tl.constexpr, FMT: tl.constexpr):
    p0 = std.port(ports, 2 * tl.program_id(0))
    p1 = std.port(ports, 2 * tl.program_id(0) + 1)
    std.call_async(p0, FN, 20, then=1001)
    std.call_async(p1, FN, 30, then=1002)                # two calls in flight on one worker
    tl.store(out + 0, std.wait(p1) + std.wait(p0))
    std.print_async(p0, FMT, 5)                          # nobody waits: stop() must still print it


@triton.jit
def print_then_fail(ports, out, FMT: tl.constexpr):
    p = std.port(ports, 0)
    std.print(p, FMT, 1)
    std.print_async(std.port(ports, 1), FMT, 2)
    offs = tl.arange(0, 4)
    tl.store(out + offs, tl.arange(0, 8))                # shapes differ: the program fails here


def sync():
    if ON_GPU:
        torch.cuda.synchronize()


@here
def test_call_print_time_clock():
    ports = allocate_ports(2)
    out = torch.zeros((2, 8), dtype=torch.int64, device=DEVICE)
    sink = io.StringIO()
    server = HostServer(ports, out=sink)
    mul = server.register_function("mul", lambda a, b: a * b, inline=True)
    half = server.register_function("half", lambda x: x / 2)           # on the pool
    fmt = intern("x=%d q=%.2f")
    before = time.time_ns()
    with server:
        calls_kernel[(2,)](ports, out, fmt, mul, half)
        sync()
    r = out.cpu()
    assert r[:, 0].tolist() == [3, 6]
    assert [torch.tensor([v]).view(torch.float64).item() for v in r[:, 1].tolist()] == [1.5, 3.0]
    assert sorted(sink.getvalue().splitlines()) == ["x=3 q=0.25", "x=6 q=0.25"]
    assert all(before <= t <= time.time_ns() for t in r[:, 2].tolist())
    assert (r[:, 3] > 0).all()                                          # the device clock moved on
    assert r[:, 4].tolist() == [Status.OK, Status.OK]
    assert server.served == 8 and server.errors == 0


@here
def test_files_read_modify_write(tmp_path):
    (tmp_path / "in.bin").write_bytes(bytes(range(40, 60)))
    ports = allocate_ports(1)
    buf = torch.zeros(64, dtype=torch.uint8, device=DEVICE)
    out = torch.zeros(8, dtype=torch.int64, device=DEVICE)
    server = HostServer(ports, files=FileTable(tmp_path))
    server.buffers.register(buf)
    with server:
        files_kernel[(1,)](ports, buf, out, intern("in.bin"), intern("out.bin"), 64)
        sync()
    fd, got, st, wrote, c1, c2 = out.cpu().tolist()[:6]
    assert fd >= 3 and got == 18 and st == Status.SHORT_READ
    assert (wrote, c1, c2) == (8, 0, 0)
    assert (tmp_path / "out.bin").read_bytes() == bytes(range(43, 51))


@here
def test_every_error_reaches_the_caller_and_the_log(tmp_path, caplog):
    (tmp_path / "ok.txt").write_bytes(b"fine")
    ports = allocate_ports(1)
    buf = torch.zeros(64, dtype=torch.uint8, device=DEVICE)
    out = torch.zeros(10, dtype=torch.int64, device=DEVICE)
    server = HostServer(ports, files=FileTable(tmp_path, read_only=True))
    server.buffers.register(buf)
    boom = server.register_function("boom", lambda x: x / 0)
    with caplog.at_level(logging.WARNING, logger="warploop.std"), server:
        errors_kernel[(1,)](ports, buf, out, boom, intern("no such function"), intern("../secret"),
                            intern("ok.txt"))
        sync()
    r = out.cpu().tolist()
    assert r[:4] == [0, Status.CALLBACK_ERROR, 0, Status.UNKNOWN_ID]
    assert r[4:8] == [-Status.NOT_PERMITTED, -Status.BAD_FD, -Status.BAD_FD, -Status.NOT_PERMITTED]
    assert r[8:] == [-Status.BAD_ARGUMENT, 0]
    assert server.errors == 7
    for word in ("ZeroDivisionError", "UNKNOWN_ID", "NOT_PERMITTED", "BAD_FD", "BAD_ARGUMENT"):
        assert word in caplog.text


@here
def test_async_calls_resume_continuations_and_late_prints_are_drained():
    ports = allocate_ports(2, slots_per_worker=2)
    out = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    sink = io.StringIO()
    resumed = []
    server = HostServer(ports, out=sink, on_reply=lambda port, then, st, res: resumed.append((port, then, st, res)))
    fn = server.register_function("plus1", lambda x: x + 1)
    server.start()
    async_kernel[(1,)](ports, out, fn, intern("late %d"))
    sync()
    server.stop()
    assert out.item() == 21 + 31
    assert sorted(resumed) == [(0, 1001, 0, 21), (1, 1002, 0, 31)]
    assert sink.getvalue() == "late 5\n"


@here
@pytest.mark.skipif(ON_GPU, reason="a GPU fault would end this process's CUDA context")
def test_prints_survive_a_program_that_fails_later():
    ports = allocate_ports(2)
    out = torch.zeros(8, dtype=torch.int64)
    sink = io.StringIO()
    server = HostServer(ports, out=sink).start()
    with pytest.raises(Exception):  # noqa: B017 - any interpreter failure will do
        print_then_fail[(1,)](ports, out, intern("step %d"))
    assert sink.getvalue().startswith("step 1\n")   # the synchronous line was out before the failure
    server.stop()
    assert sink.getvalue() == "step 1\nstep 2\n"    # the posted one is out by the end of stop()


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="compiles; the parent process does it")
@pytest.mark.parametrize("target", ["cuda:90", "hip:gfx942"])
def test_device_code_compiles_for_gpus_without_one(target):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    backend, arch = target.split(":")
    gpu = GPUTarget(backend, int(arch) if backend == "cuda" else arch, 32 if backend == "cuda" else 64)
    for kernel, signature, constexprs in (
            (calls_kernel, {"ports": "*i64", "out": "*i64"}, {"FMT": 1, "MUL": 2, "HALF": 3}),
            (files_kernel, {"ports": "*i64", "buf": "*u8", "out": "*i64"}, {"READ_PATH": 1, "WRITE_PATH": 2,
                                                                          "NBYTES": 64}),
            (async_kernel, {"ports": "*i64", "out": "*i64"}, {"FN": 1, "FMT": 2})):
        compiled = triton.compile(ASTSource(kernel, signature, constexprs), target=gpu, options={"num_warps": 1})
        if backend == "cuda":
            ptx = compiled.asm["ptx"]
            assert "atom.global.sys.release.exch.b64" in ptx          # the post: release, system scope
            assert "ld.volatile.global" in ptx                        # the poll
        if kernel is calls_kernel:
            asm = compiled.asm["ptx" if backend == "cuda" else "amdgcn"]
            assert ("%globaltimer" if backend == "cuda" else "s_memrealtime") in asm   # clock, no host trip
