"""Tasks of a warploop.Runtime call the host: print, call, time, clock and file reads into a device
buffer, through HostCalls' ports (Runtime(ports=...)). On the CPU executor and, when there is one,
on the GPU's resident kernel."""
from __future__ import annotations

import io

import pytest
import torch
import triton
import triton.language as tl

import warploop
from warploop.runtime import device as wl
from warploop.std import HostCalls, intern
from warploop.std import device as std

FMT = intern("task %d: square %d, %d bytes")
SQUARE = intern("test_std_runtime.square")
PATH = intern("data.bin")


@warploop.task(signature={"buf": "*u8", "out": "*i64", "n": "i32"},
               constexprs={"FMT": FMT, "SQUARE": SQUARE, "PATH": PATH})
@triton.jit
def host_calls_task(ctx, buf, out, n, FMT: tl.constexpr, SQUARE: tl.constexpr, PATH: tl.constexpr):
    p = std.task_port(ctx)
    t0 = std.clock()
    y = std.call(p, SQUARE, n)
    fd = std.open(p, PATH, std.O_READ)
    got = std.read(p, fd, buf + n * 16, 16, n)
    std.close(p, fd)
    std.print(p, FMT, n, y, got)
    tl.store(out + n * 4 + 0, y)
    tl.store(out + n * 4 + 1, got)
    tl.store(out + n * 4 + 2, std.time(p))
    tl.store(out + n * 4 + 3, std.clock() - t0)
    wl.set_result(ctx, std.call(p, SQUARE, -1) + std.status(p))


# The GPU where there is one, else the CPU executor (which is what CI, without a GPU, runs).
DEVICES = ["cuda"] if torch.cuda.is_available() else ["cpu"]


@pytest.mark.parametrize("device", DEVICES)
def test_tasks_call_the_host(device, tmp_path):
    (tmp_path / "data.bin").write_bytes(bytes(range(64)))
    sink = io.StringIO()
    buf = torch.zeros(16 * 8, dtype=torch.uint8, device=device)
    out = torch.zeros(8 * 4, dtype=torch.int64, device=device)
    calls = HostCalls(files_root=tmp_path, read_only=True, device=device, out=sink,
                      functions={"test_std_runtime.square": lambda x: x * x})
    calls.register_buffer(buf)
    with calls, warploop.Runtime(device=device, tasks=[host_calls_task], workers=2, ports=calls.ports) as rt:
        calls.bind(rt)
        futures = [rt.submit(host_calls_task, buf, out, n) for n in range(1, 7)]
        assert [f.result(timeout=60) for f in futures] == [1] * 6
    r = out.cpu().view(8, 4)
    assert r[1:7, 0].tolist() == [n * n for n in range(1, 7)]
    assert r[1:7, 1].tolist() == [16] * 6
    assert (r[1:7, 2] > 1_700_000_000 * 10**9).all() and (r[1:7, 3] > 0).all()
    assert buf.cpu().view(8, 16)[1:7].tolist() == [list(range(n, n + 16)) for n in range(1, 7)]
    assert sorted(sink.getvalue().splitlines()) == sorted(f"task {n}: square {n * n}, 16 bytes" for n in range(1, 7))
    assert calls.server.errors == 0
