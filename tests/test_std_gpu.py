"""On a GPU: thousands of concurrent calls from every worker, none lost, doubled or answered with
another call's result; every line printed exactly once; a file read into device memory intact.
(test_std_calls.py and test_std_grep.py run on the GPU too when there is one.)"""
from __future__ import annotations

import collections
import io
import threading

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]

if torch.cuda.is_available():
    import triton
    import triton.language as tl

    from warploop.std import FileTable, HostServer, allocate_ports, intern
    from warploop.std import device as std
    from warploop.std.protocol import Word

    @triton.jit
    def storm_kernel(ports, bad, n, FN: tl.constexpr, ASYNC_FN: tl.constexpr, FMT: tl.constexpr):
        w = tl.program_id(0)
        p = std.port(ports, 2 * w)
        q = std.port(ports, 2 * w + 1)
        wrong = 0
        i = 0
        while i < n:
            std.call_async(q, ASYNC_FN, w, i)                # one call in flight while another runs
            wrong += (std.call(p, FN, w, i) != w * 1000003 + i).to(tl.int32)
            wrong += (std.wait(q) != -(w * 1000003 + i)).to(tl.int32)
            if i % 16 == 0:
                std.print(p, FMT, w, i)
            i += 1
        tl.store(bad + w, wrong)

    @triton.jit
    def chunked_read_kernel(ports, dst, path, size, CHUNK: tl.constexpr):
        p = std.port(ports, tl.program_id(0))
        fd = std.open(p, path, std.O_READ)
        off = tl.program_id(0) * CHUNK          # every program reads its own chunks of one file
        while off < size:
            std.read(p, fd, dst + off, tl.minimum(size - off, CHUNK), off)
            off += tl.num_programs(0) * CHUNK
        std.close(p, fd)


@pytest.mark.parametrize("mode", ["inline", "pool", "vectorized"])
def test_thousands_of_concurrent_calls(mode):
    workers = 4 * torch.cuda.get_device_properties(0).multi_processor_count
    n = 32 if mode != "pool" else 8
    ports = allocate_ports(workers, slots_per_worker=2)
    seen = collections.Counter()
    lock = threading.Lock()

    def record(a, b):
        if mode == "vectorized":
            with lock:
                seen.update(zip(np.asarray(a).tolist(), np.asarray(b).tolist(), strict=True))
        else:
            with lock:
                seen[(a, b)] += 1
        return a * 1000003 + b

    sink = io.StringIO()
    bad = torch.zeros(workers, dtype=torch.int32, device="cuda")
    server = HostServer(ports, out=sink)
    fn = server.register_function(f"record_{mode}", record, inline=mode == "inline", vectorized=mode == "vectorized")
    neg = server.register_function("negate_tag", lambda a, b: -(a * 1000003 + b), inline=mode != "pool")
    with server:
        storm_kernel[(workers,)](ports, bad, n, fn, neg, intern("w%d i%d"), num_warps=1)
        torch.cuda.synchronize()
    assert int(bad.sum()) == 0
    assert len(seen) == workers * n and set(seen.values()) == {1}
    prints = len(range(0, n, 16))
    assert ports[0::2, Word.SEQ].eq(n + prints).all() and ports[1::2, Word.SEQ].eq(n).all()   # one reply per call
    lines = sink.getvalue().splitlines()
    assert sorted(lines) == sorted(f"w{w} i{i}" for w in range(workers) for i in range(0, n, 16))
    assert server.errors == 0 and server.served == 2 * workers * n + workers * prints


def test_parallel_chunked_read_lands_intact(tmp_path):
    data = np.random.default_rng(1).integers(0, 256, (40 << 20) + 123, dtype=np.uint8)
    data.tofile(tmp_path / "blob.bin")
    programs = 8
    ports = allocate_ports(programs)
    dst = torch.zeros(len(data), dtype=torch.uint8, device="cuda")
    server = HostServer(ports, files=FileTable(tmp_path, read_only=True))
    server.buffers.register(dst)
    with server:
        chunked_read_kernel[(programs,)](ports, dst, intern("blob.bin"), len(data), CHUNK=3 << 20, num_warps=1)
        torch.cuda.synchronize()
    assert torch.equal(dst.cpu(), torch.from_numpy(data))
    assert server.errors == 0
