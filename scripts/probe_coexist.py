"""Probe: which CUDA work completes beside a never-ending kernel, and in which configuration.

Each mode runs in a fresh child process with a deadline, so a hang is a result, not a lost run:

    primary-lazy   spin kernel in the primary context, CUDA_MODULE_LOADING=LAZY (torch's default)
    primary-eager  the same with CUDA_MODULE_LOADING=EAGER
    green-lazy     spin kernel in a green context of SPIN_SMS SMs (its own module and stream), LAZY
    green-eager    the same, EAGER

Then, while it spins, the child runs work that loads never-used kernels in the primary context
(torch RNG, elementwise, cuBLAS, sort, a fresh Triton JIT kernel, a CUDA graph, stream and device
synchronisation, empty_cache), printing one line per step. Run: python scripts/probe_coexist.py
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

SPIN_SMS = 16
STEP_DEADLINE_S = 25


def child(mode: str) -> None:
    import ctypes

    import torch
    import triton
    import triton.language as tl
    from cuda.bindings import driver as cu

    def say(*a):
        print(*a, flush=True)

    @triton.jit
    def spin(flag, hb):
        tl.atomic_xchg(hb, 1, sem="release", scope="sys")
        while tl.load(flag, volatile=True) == 0:
            tl.inline_asm_elementwise("nanosleep.u32 2000; mov.u32 $0, 0;", "=r", [], dtype=tl.int32,
                                      is_pure=False, pack=1)
        tl.atomic_xchg(hb + 1, 1, sem="release", scope="sys")

    torch.zeros(1, device="cuda")                      # torch's primary context exists
    err, lmode = cu.cuModuleGetLoadingMode()
    say("loading_mode", lmode)
    flag = torch.zeros(2, dtype=torch.int32, pin_memory=True)
    hb = torch.zeros(2, dtype=torch.int32, pin_memory=True)
    k = spin.warmup(flag, hb, grid=(1,))
    cubin, name = k.asm["cubin"], k.metadata.name
    nthreads = 32 * k.metadata.num_warps
    params = ((flag.data_ptr(), hb.data_ptr(), 0, 0), (ctypes.c_void_p,) * 4)
    t0 = time.perf_counter()
    if mode.startswith("none"):
        hb[0] = 1
    elif mode.startswith("runtime"):
        import warploop
        from warploop.bench.runtime_kernels import tick

        counter = torch.zeros(1, dtype=torch.int32, device="cuda")
        rt = warploop.Runtime(tasks=[tick], timeout=20)
        rt.submit(tick, counter).result(timeout=10)
        hb[0] = 1
    elif mode.startswith("green"):
        err, dev = cu.cuDeviceGet(0)
        err, res = cu.cuDeviceGetDevResource(dev, cu.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM)
        say("sm resource", err, res.sm.smCount, res.sm.minSmPartitionSize, res.sm.smCoscheduledAlignment)
        err, groups, ngroups, rest = cu.cuDevSmResourceSplitByCount(1, res, 0, SPIN_SMS)
        say("split", err, ngroups, groups[0].sm.smCount, rest.sm.smCount)
        err, desc = cu.cuDevResourceGenerateDesc([groups[0]], 1)
        say("desc", err)
        err, gctx = cu.cuGreenCtxCreate(desc, dev, cu.CUgreenCtxCreate_flags.CU_GREEN_CTX_DEFAULT_STREAM)
        say("green", err)
        err, ctx = cu.cuCtxFromGreenCtx(gctx)
        err = cu.cuCtxPushCurrent(ctx)
        err, mod = cu.cuModuleLoadData(cubin)
        err, fn = cu.cuModuleGetFunction(mod, name.encode())
        err, stream = cu.cuGreenCtxStreamCreate(gctx, cu.CUstream_flags.CU_STREAM_NON_BLOCKING, 0)
        grid = groups[0].sm.smCount
        err = cu.cuLaunchKernel(fn, grid, 1, 1, nthreads, 1, 1, k.metadata.shared, stream, params, 0)
        say("launch", err, "grid", grid)
        cu.cuCtxPopCurrent()
    else:
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            spin[(SPIN_SMS,)](flag, hb)
    while hb[0].item() == 0:
        if time.perf_counter() - t0 > 20:
            say("FAIL spin kernel never started")
            return
        time.sleep(1e-3)
    say("spinning after", round((time.perf_counter() - t0) * 1e3, 1), "ms")

    @triton.jit
    def fresh_copy(x, y, n, BLOCK: tl.constexpr):
        o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(y + o, tl.load(x + o, mask=o < n) * 2, mask=o < n)

    def graph_replay():
        x = torch.ones(1024, device="cuda")
        s = torch.cuda.Stream()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.stream(s):
            x.mul_(1.0)
            s.synchronize()
            with torch.cuda.graph(g, stream=s):
                x.mul_(3.0)
            g.replay()
        s.synchronize()
        return float(x[0].item())

    side = torch.ones(1 << 20)
    dev = {}

    def sync():
        torch.cuda.current_stream().synchronize()

    steps = [
        ("alloc", lambda: dev.setdefault("x", torch.empty(1 << 20, device="cuda")).shape[0]),
        ("h2d_copy", lambda: dev["x"].copy_(side).shape[0]),
        ("known_fill", lambda: (torch.zeros(1024, device="cuda"), sync())[1]),
        ("new_add", lambda: (dev["x"].add_(1), sync())[1]),
        ("item", lambda: float(dev["x"][0].item())),
        ("randn", lambda: float(torch.randn(1 << 20, device="cuda").abs().mean().item())),
        ("add", lambda: float((torch.ones(100, device="cuda") + 1).sum().item())),
        ("matmul_bf16", lambda: float((torch.ones(512, 512, device="cuda", dtype=torch.bfloat16)
                                       @ torch.ones(512, 512, device="cuda", dtype=torch.bfloat16))[0, 0].item())),
        ("sort", lambda: float(torch.sort(torch.rand(100000, device="cuda"))[0][-1].item())),
        ("triton_fresh", lambda: (lambda x, y: (fresh_copy[(4,)](x, y, 4096, BLOCK=1024), float(y.sum().item())))(
            torch.ones(4096, device="cuda"), torch.empty(4096, device="cuda"))[1]),
        ("cuda_graph", graph_replay),
        ("stream_sync", lambda: torch.cuda.current_stream().synchronize()),
        ("empty_cache", lambda: torch.cuda.empty_cache()),
        ("device_sync", lambda: torch.cuda.synchronize()),
    ]
    for label, fn in steps:
        say("start", label)
        t = time.perf_counter()
        out = fn()
        say("ok", label, round((time.perf_counter() - t) * 1e3, 2), "ms", out)
    flag[0] = 1
    t = time.perf_counter()
    if mode.startswith("runtime"):
        rt.close()
        hb[1] = 1
    while hb[1].item() == 0 and time.perf_counter() - t < 2 and not mode.startswith("none"):
        time.sleep(1e-3)
    say("stopped" if hb[1].item() or mode.startswith("none") else "still spinning",
        round((time.perf_counter() - t) * 1e3, 1))


def main() -> None:
    modes = sys.argv[1:] or ["none-lazy", "primary-lazy", "primary-eager", "green-lazy", "green-eager",
                             "runtime-lazy", "runtime-eager"]
    results = {}
    for mode in modes:
        env = dict(os.environ, CUDA_MODULE_LOADING="EAGER" if mode.endswith("eager") else "LAZY",
                   PYTHONUNBUFFERED="1")
        t = time.perf_counter()
        try:
            p = subprocess.run([sys.executable, __file__, "--child", mode], env=env, capture_output=True,
                               text=True, timeout=STEP_DEADLINE_S)
            out, rc = p.stdout + p.stderr[-2000:], p.returncode
        except subprocess.TimeoutExpired as e:
            out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            rc = "TIMEOUT"
        results[mode] = {"rc": rc, "s": round(time.perf_counter() - t, 1), "log": out.splitlines()}
        print(f"== {mode}: rc={rc} in {results[mode]['s']} s", flush=True)
        print(out, flush=True)
    out_dir = os.environ.get("OUT")
    if out_dir:
        with open(os.path.join(out_dir, "coexist-probe.json"), "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        child(sys.argv[2])
    else:
        main()
