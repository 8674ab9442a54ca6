"""`warploop bench hostcall`: GPU->host calls through warploop.std.

    call_p50_us, call_p99_us   round trip of a no-op `call` from one worker (device clock per call;
                               the function is registered inline, i.e. run on the server thread)
    calls_per_s                every worker calling at once (a vectorized no-op: one numpy call
                               per server pass); the inline and pooled variants are reported beside it
    print_lines_per_s          every worker printing; print_lost counts lines missing or doubled
    file_read_gbps             1 GiB of files read into device memory by std.read from the device
    plain_read_gbps            the same files, open().read() + copy to the GPU, in the same run
                               (plain_pinned_read_gbps: readinto a pinned buffer + copy, one thread)

then_p50_us, then_p99_us (hostcall_then.py): the same no-op call posted by a runtime task with a
continuation: post -> continuation start.

Peer in the same run: `raw_roundtrip_us`, the bare single-word ring of shared/probes/feasibility2.py
(one Python thread, no protocol), which is the floor for a Python-served call. Without a GPU the same
kernels run in the Triton interpreter with small sizes, so the figures only show that it works.
"""
from __future__ import annotations

import os
import statistics
import sys
import tempfile
import threading
import time
import warnings

import torch

if not torch.cuda.is_available() and "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")   # must precede importing Triton

import numpy as np  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from warploop.bench.common import emit, header, result_path  # noqa: E402
from warploop.bench.hostcall_then import measure_then  # noqa: E402
from warploop.std import Buffers, FileTable, HostServer, allocate_ports, intern  # noqa: E402
from warploop.std import device as std  # noqa: E402


@triton.jit
def latency_kernel(ports, times, n, FN: tl.constexpr):
    p = std.port(ports, 0)
    i = 0
    while i < n:
        t0 = std.clock()
        std.call(p, FN)
        tl.store(times + i, std.clock() - t0)
        i += 1


@triton.jit
def throughput_kernel(ports, bad, n, FN: tl.constexpr):
    w = tl.program_id(0)
    p = std.port(ports, w)
    wrong = 0
    i = 0
    while i < n:
        wrong += (std.call(p, FN, w, i) != w * 1000003 + i).to(tl.int32)
        i += 1
    tl.store(bad + w, wrong)


@triton.jit
def print_kernel(ports, n, FMT: tl.constexpr):
    w = tl.program_id(0)
    p = std.port(ports, w)
    i = 0
    while i < n:
        std.print(p, FMT, w, i)
        i += 1


@triton.jit
def read_kernel(ports, dst, path_ids, sizes, starts, CHUNK: tl.constexpr):
    w = tl.program_id(0)
    p = std.port(ports, w)
    fd = std.open(p, tl.load(path_ids + w), std.O_READ)
    size = tl.load(sizes + w)
    base = dst + tl.load(starts + w)
    off = tl.zeros((), tl.int64)
    while off < size:
        got = std.read(p, fd, base + off, tl.minimum(size - off, CHUNK), off)
        off += tl.where(got > 0, got, size)     # an error ends the loop; the checksum catches it
    std.close(p, fd)


@triton.jit
def raw_ring_kernel(ring, n):
    k = 1
    while k <= n:
        tl.atomic_xchg(ring, k, sem="release", scope="sys")
        while tl.atomic_add(ring + 16, 0, sem="acquire", scope="sys") != k:
            pass
        k += 1


def tag(a, b):
    return a * 1000003 + b


class LineCounter:
    """An output stream that keeps the (worker, i) of every line, to find lost or doubled ones."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    def write(self, text: str) -> None:
        self.seen.append(text)

    def flush(self) -> None:
        pass

    def lines(self) -> list[str]:
        return "".join(self.seen).splitlines()


def sync(gpu: bool) -> None:
    if gpu:
        torch.cuda.synchronize()


def measure_latency(gpu: bool, n: int) -> dict:
    ports = allocate_ports(1)
    times = torch.zeros(n, dtype=torch.int64, device="cuda" if gpu else "cpu")
    out = {}
    for mode in ("inline", "pool"):
        with HostServer(ports) as server:
            fn = server.register_function(f"noop_{mode}", lambda: 0, inline=mode == "inline")
            latency_kernel[(1,)](ports, times, n, fn, num_warps=1)   # warm: compile and first pass
            sync(gpu)
            latency_kernel[(1,)](ports, times, n, fn, num_warps=1)
            sync(gpu)
        us = np.sort(times.cpu().numpy()[n // 10:]) / 1e3          # drop the first 10%
        out[mode] = (float(np.percentile(us, 50)), float(np.percentile(us, 99)))
    return {"call_p50_us": out["inline"][0], "call_p99_us": out["inline"][1],
            "call_pool_p50_us": out["pool"][0], "call_pool_p99_us": out["pool"][1]}


def measure_throughput(gpu: bool, programs: int, n: int) -> dict:
    ports = allocate_ports(programs)
    bad = torch.zeros(programs, dtype=torch.int32, device="cuda" if gpu else "cpu")
    out = {}
    for mode in ("vectorized", "inline"):
        with HostServer(ports) as server:
            fn = server.register_function(f"tag_{mode}", tag, inline=True, vectorized=mode == "vectorized")
            throughput_kernel[(programs,)](ports, bad, 2, fn, num_warps=1)
            sync(gpu)
            t0 = time.perf_counter()
            throughput_kernel[(programs,)](ports, bad, n, fn, num_warps=1)
            sync(gpu)
            elapsed = time.perf_counter() - t0
        if int(bad.sum()):
            raise RuntimeError(f"{int(bad.sum())} calls came back with another call's result ({mode})")
        out[mode] = programs * n / elapsed
    return {"calls_per_s": out["vectorized"], "calls_per_s_inline": out["inline"], "call_workers": programs}


def measure_prints(gpu: bool, programs: int, n: int) -> dict:
    ports = allocate_ports(programs)
    sink = LineCounter()
    fmt = intern("worker %d line %d")
    with HostServer(ports, out=sink):
        print_kernel[(programs,)](ports, 1, fmt, num_warps=1)
        sync(gpu)
        sink.seen.clear()
        t0 = time.perf_counter()
        print_kernel[(programs,)](ports, n, fmt, num_warps=1)
        sync(gpu)
        elapsed = time.perf_counter() - t0
    lines = sink.lines()
    expected = {f"worker {w} line {i}" for w in range(programs) for i in range(n)}
    lost = len(expected - set(lines)) + (len(lines) - len(set(lines)))
    return {"print_lines_per_s": len(lines) / elapsed, "print_lost": lost, "print_workers": programs}


def measure_files(gpu: bool, total_bytes: int, nfiles: int, reps: int) -> dict:
    device = "cuda" if gpu else "cpu"
    size = total_bytes // nfiles
    with tempfile.TemporaryDirectory(prefix="wl-hostcall-") as root:
        rng = np.random.default_rng(0)
        names = [f"part{i:03d}.bin" for i in range(nfiles)]
        for name in names:
            rng.integers(0, 256, size, dtype=np.uint8).tofile(os.path.join(root, name))
        dst = torch.empty(nfiles * size, dtype=torch.uint8, device=device)
        ref = torch.empty_like(dst)

        def plain():
            for i, name in enumerate(names):
                with open(os.path.join(root, name), "rb") as f:
                    data = f.read()
                with warnings.catch_warnings():   # bytes are read-only; the copy never writes them
                    warnings.simplefilter("ignore")
                    ref[i * size:(i + 1) * size].copy_(torch.frombuffer(data, dtype=torch.uint8))
            sync(gpu)

        staging = torch.empty(size, dtype=torch.uint8, pin_memory=gpu)

        def plain_pinned():   # a stronger peer: read into pinned memory, one copy, one thread
            view = memoryview(staging.numpy())
            for i, name in enumerate(names):
                with open(os.path.join(root, name), "rb", buffering=0) as f:
                    f.readinto(view)
                ref[i * size:(i + 1) * size].copy_(staging)
            sync(gpu)

        ports = allocate_ports(nfiles)
        path_ids = torch.tensor([intern(n) for n in names], dtype=torch.int64, device=device)
        sizes = torch.full((nfiles,), size, dtype=torch.int64, device=device)
        starts = torch.arange(nfiles, dtype=torch.int64, device=device) * size
        server = HostServer(ports, files=FileTable(root, read_only=True), buffers=Buffers(staging_lanes=8),
                            pool_workers=8)
        server.buffers.register(dst)
        plain_s, pinned_s, calls_s = [], [], []
        with server:
            def via_calls():
                read_kernel[(nfiles,)](ports, dst, path_ids, sizes, starts, CHUNK=16 << 20, num_warps=1)
                sync(gpu)
            plain()          # warm: page cache, compile
            via_calls()
            for _ in range(reps):
                dst.fill_(0)
                t0 = time.perf_counter()
                plain()
                plain_s.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                plain_pinned()
                pinned_s.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                via_calls()
                calls_s.append(time.perf_counter() - t0)
        if not torch.equal(dst, ref):
            raise RuntimeError("bytes read through file calls differ from the plain read")
    gb = nfiles * size / 1e9
    return {"file_read_gbps": gb / statistics.median(calls_s), "plain_read_gbps": gb / statistics.median(plain_s),
            "plain_pinned_read_gbps": gb / statistics.median(pinned_s),
            "file_read_bytes": nfiles * size, "file_read_files": nfiles}


def measure_raw_ring(n: int) -> float:
    """The probe's bare ring: one word out, one word back, a Python thread spinning on it."""
    ring_t = torch.zeros(64, dtype=torch.int32, pin_memory=True)
    ring = ring_t.numpy()

    def serve(rounds):
        seen = 0
        while seen < rounds:
            r = ring[0]
            if r != seen:
                ring[16] = r
                seen = r
    for rounds in (10, n):
        ring[:] = 0
        th = threading.Thread(target=serve, args=(rounds,))
        th.start()
        t0 = time.perf_counter()
        raw_ring_kernel[(1,)](ring_t, rounds, num_warps=1)
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
        th.join()
    return elapsed / n * 1e6


def add_arguments(parser) -> None:
    from warploop.args import positive_int

    parser.add_argument("--json", action="store_true", help="print one JSON object (default: a short table)")
    parser.add_argument("--save", action="store_true", help="also write bench/results/hostcall-<device>-<date>.json")
    parser.add_argument("--file-mib", type=positive_int, default=None,
                        help="MiB of files to read (default 1024 on a GPU)")


def main(args) -> int:
    gpu = torch.cuda.is_available()
    if not gpu and not os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("no GPU and Triton was imported before TRITON_INTERPRET=1 could be set; "
                         "run `TRITON_INTERPRET=1 warploop bench hostcall`")
    sms = torch.cuda.get_device_properties(0).multi_processor_count if gpu else 2
    result = header("hostcall")
    result.update(measure_latency(gpu, 5000 if gpu else 30))
    best = {}
    for programs in ((sms, 4 * sms) if gpu else (2,)):
        r = measure_throughput(gpu, programs, 2000 if gpu else 10)
        if r["calls_per_s"] > best.get("calls_per_s", 0):
            best = r
    result.update(best)
    result.update(measure_prints(gpu, sms if gpu else 2, 500 if gpu else 10))
    mib = args.file_mib or (1024 if gpu else 8)
    result.update(measure_files(gpu, mib << 20, 16 if gpu else 2, 3 if gpu else 1))
    result["file_read_ratio"] = result["file_read_gbps"] / result["plain_read_gbps"]
    result["raw_roundtrip_us"] = measure_raw_ring(5000) if gpu else None
    try:   # needs a resident runtime as well: a failure here must not lose the figures above
        result.update(measure_then(gpu, 2000 if gpu else 10))
    except Exception as e:
        result["then_error"] = repr(e)
    if args.json:
        emit(result, result_path("hostcall") if args.save else None)
    else:
        for key, value in result.items():
            if key not in ("versions",):
                print(f"{key:>22}  {value:.3f}" if isinstance(value, float) else f"{key:>22}  {value}")
    return 0
