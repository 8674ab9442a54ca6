"""GPU half of `warploop bench runtime` (see runtime.py for what is measured and why)."""
from __future__ import annotations

import statistics
import sys
import time

import warploop
from warploop.bench.runtime_clocks import ClockSampler
from warploop.bench.runtime_coexist import coexist_figures
from warploop.bench.runtime_fanout import fanout_figures
from warploop.bench.runtime_hop import hop_figures
from warploop.bench.runtime_kernels import HOP_TASKS, gemv_kernel, gemv_kernel_unrolled, noop, spawn_tree
from warploop.bench.runtime_mlp_tasks import MLP_SCHEDULES
from warploop.bench.runtime_submit import submit_breakdown
from warploop.bench.timing import copy_gbs, events_us, graph_of, submit_latency

DIM, HIDDEN = 2048, 8192
MLP_WORKERS = 256
CLOCKS = ClockSampler()         # started by gpu_figures; each section reports the clocks it saw


def mlp_weights(torch, layers: int):
    g = torch.Generator(device="cuda").manual_seed(int(time.time_ns() % 2**31))
    w1 = [(torch.randn(HIDDEN, DIM, device="cuda", generator=g) / DIM ** 0.5).bfloat16() for _ in range(layers)]
    w2 = [(torch.randn(DIM, HIDDEN, device="cuda", generator=g) / HIDDEN ** 0.5).bfloat16() for _ in range(layers)]
    x0 = torch.randn(DIM, device="cuda", generator=g).bfloat16()
    return w1, w2, x0


def reference(torch, w1, w2, x0):
    x = x0.float()
    for a, b in zip(w1, w2, strict=True):
        h = torch.nn.functional.silu(a.float() @ x)
        x = b.float() @ h.bfloat16().float()
        x = x.bfloat16().float()
    return x


def rel_err(torch, out, ref) -> float:
    out = out.float()
    return float((out - ref).norm() / ref.norm()) if torch.isfinite(out).all() else float("inf")


def gemv_launcher(w, x, y, k, silu: bool, bn: int, bk: int, warps: int, unrolled: bool):
    """One per-op GEMV launch; unrolled: the resident kernel's unrolled body (compile-time k)."""
    if unrolled:
        return lambda: gemv_kernel_unrolled[(w.shape[0] // bn,)](w, x, y, k, bn, bk, k, silu, num_warps=warps)
    return lambda: gemv_kernel[(w.shape[0] // bn,)](w, x, y, k, bn, bk, silu, num_warps=warps)


def best_config(torch, ws, x, y, k, silu: bool, configs) -> tuple:
    """The fastest config by device time per launch inside a CUDA graph (timed launch by launch
    from Python, a ~10 us GEMV is launch-bound and the choice would be noise), one launch per
    matrix in ws (every layer's: more than L2 holds, so weights come from HBM as in the stack)."""
    best = None
    for cfg in configs:
        launches = [gemv_launcher(w, x, y, k, silu, *cfg) for w in ws]
        graph = graph_of(torch, lambda launches=launches: [f() for f in launches], 1)
        us = events_us(torch, graph.replay, trials=5) / len(ws)
        if best is None or us < best[0]:
            best = (us, *cfg)
    return best


def mlp_peers(torch, w1, w2, x0, quick: bool) -> dict:
    layers = len(w1)
    h = torch.empty(HIDDEN, dtype=torch.bfloat16, device="cuda")
    xs = [x0] + [torch.empty(DIM, dtype=torch.bfloat16, device="cuda") for _ in range(layers)]
    # (BN, BK, warps, unrolled): the unrolled body is the runtime's new tile, offered to the peer too.
    up_cfgs = [(16, 512, 4, True), (32, 256, 4, True), (16, 512, 4, False), (32, 256, 4, False),
               (8, 1024, 4, False), (32, 512, 8, False)][: 3 if quick else 6]
    down_cfgs = [(4, 2048, 4, True), (8, 1024, 4, True), (8, 1024, 4, False), (4, 2048, 4, False),
                 (16, 512, 4, False), (8, 2048, 8, False)][: 3 if quick else 6]
    up = best_config(torch, w1, x0, h, DIM, True, up_cfgs)
    down = best_config(torch, w2, h, xs[1], HIDDEN, False, down_cfgs)

    def per_op():
        for i in range(layers):
            gemv_launcher(w1[i], xs[i], h, DIM, True, *up[1:])()
            gemv_launcher(w2[i], h, xs[i + 1], HIDDEN, False, *down[1:])()

    graph = graph_of(torch, per_op, 1)
    xs[-1].fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    peer_out = xs[-1].clone()
    graph_us = events_us(torch, graph.replay, reps=5)

    def eager():
        x = x0
        for a, b in zip(w1, w2, strict=True):
            x = torch.mv(b, torch.nn.functional.silu(torch.mv(a, x)))
        return x

    eager_out = eager()
    eager_us = events_us(torch, eager, reps=5)
    return {"cuda_graph_us": graph_us, "torch_eager_us": eager_us, "peer_out": peer_out, "eager_out": eager_out,
            "per_op_configs": {"up": {"BN": up[1], "BK": up[2], "warps": up[3], "unrolled": up[4], "us": up[0]},
                               "down": {"BN": down[1], "BK": down[2], "warps": down[3], "unrolled": down[4],
                                        "us": down[0]}}}


def runtime_tasks(torch, repeat: int, rounds: int) -> dict:
    """Tiny tasks per second (spawned on the GPU, and as one static graph) and the host submit round
    trip with its per-stage device breakdown (runtime_submit.py)."""
    props = torch.cuda.get_device_properties(0)
    counter = torch.zeros(1, dtype=torch.int32, device="cuda")
    with warploop.Runtime(device="cuda", tasks=HOP_TASKS, workers=props.multi_processor_count, worker_warps=1,
                          pool=1 << 18) as rt:
        fan, each = rt.workers, 1000
        rt.submit(spawn_tree, counter, fan, 10).result(timeout=30)
        counter_start = int(counter.cpu())
        t0 = time.perf_counter()
        rt.submit(spawn_tree, counter, fan, each).result(timeout=30)
        elapsed = time.perf_counter() - t0
        dyn_ok = int(counter.cpu()) - counter_start == fan * each
        wide = rt.graph()
        for i in range(64 * rt.workers):
            wide.add(noop, worker=i % rt.workers)
        wide.run(timeout=30)
        f = wide.launch(repeat=repeat)
        f.result(timeout=30)
        graph_tasks_per_s = len(wide) * repeat / (f.device_ns / 1e9)
        p50, p99, host_us = submit_latency(rt, noop, (), rounds)
        breakdown = submit_breakdown(rt, rounds=min(rounds, 1000), task=noop)
    return {"tasks_per_s": (fan * each + fan + 1) / elapsed, "tasks_ok": dyn_ok, "graph_tasks_per_s": graph_tasks_per_s,
            "submit_p50_us": p50, "submit_p99_us": p99, "submit_host_p50_us": host_us,
            "submit_breakdown": breakdown}


def mlp_nodes(w1, w2, xs, h, up: dict, down: dict) -> list[tuple]:
    """(GEMV index, up?, args, worker) per node, in recording order: tile t of a GEMV runs on worker
    t % MLP_WORKERS (one tile each)."""
    nodes = []
    for i in range(len(w1)):
        nodes += [(2 * i, True, (w1[i], xs[i], h, DIM, r), t % MLP_WORKERS)
                  for t, r in enumerate(range(0, HIDDEN, up["BN"]))]
        nodes += [(2 * i + 1, False, (w2[i], h, xs[i + 1], HIDDEN, r), t % MLP_WORKERS)
                  for t, r in enumerate(range(0, DIM, down["BN"]))]
    return nodes


def runtime_mlp(torch, w1, w2, x0, repeat: int, variant: str, deps: bool = True) -> dict:
    """The stack as one static graph. deps=False drops every edge (a diagnostic: the output is
    wrong, the time is the tile bodies and the worker loop without any GEMV boundary)."""
    up_task, down_task, up, down = MLP_SCHEDULES[variant]
    layers = len(w1)
    h = torch.empty(HIDDEN, dtype=torch.bfloat16, device="cuda")
    xs = [x0] + [torch.full((DIM,), float("nan"), dtype=torch.bfloat16, device="cuda") for _ in range(layers)]
    # 256 tiles per GEMV: 256 workers run one each, about two workers per SM.
    with warploop.Runtime(device="cuda", tasks=[up_task, down_task], workers=MLP_WORKERS) as rt:
        g = rt.graph()
        prev, cur, at = [], [], 0
        for gemv, is_up, args, worker in mlp_nodes(w1, w2, xs, h, up, down):
            if gemv != at:
                prev, cur, at = cur, [], gemv
            cur.append(g.add(up_task if is_up else down_task, *args, after=prev if deps else (), worker=worker))
        t0 = time.perf_counter()
        g.run(timeout=30)
        first_run_s = time.perf_counter() - t0
        out = xs[-1].cpu().cuda()       # a copy, not a kernel: the runtime holds the SMs
        per_run = []
        for _ in range(5):
            f = g.launch(repeat=repeat)
            f.result(timeout=30)
            per_run.append(f.device_ns / 1e3 / repeat)
        replay_out = xs[-1].cpu().cuda()
        workers = rt.workers
    return {"warploop_us": statistics.median(per_run), "warploop_out": out, "replay_out": replay_out,
            "workers": workers, "nodes": len(g), "counters": len(g.schedule.counter_sizes),
            "first_run_s": first_run_s, "tiles": {"up": up, "down": down}, "variant": variant,
            "per_gemv_us": statistics.median(per_run) / (2 * layers)}


def section(name: str, fn, *args, **kwargs) -> dict:
    """Run one part; on failure record the error (later parts still run) instead of losing the rest."""
    t0, t0_wall = time.perf_counter(), time.time()
    try:
        out = fn(*args, **kwargs)
    except Exception as exc:  # a benchmark reports what broke; it does not hide it
        print(f"[bench runtime] {name}: FAILED {exc!r}"[:2000], file=sys.stderr, flush=True)
        return {"error": f"{type(exc).__name__}: {exc}"[:2000]}
    clocks = CLOCKS.window(t0_wall, time.time())
    if clocks:
        out["clocks"] = clocks
    shown = {k: v for k, v in out.items() if isinstance(v, (int, float, bool, str))}
    if clocks:
        shown["sm_mhz_median"] = clocks["sm_mhz_median"]
    print(f"[bench runtime] {name} ({time.perf_counter() - t0:.1f} s): {shown}", file=sys.stderr, flush=True)
    return out


def gpu_figures(quick: bool, layers: int, only: str | None = None) -> dict:
    """All figures; only="hops" or "mlp" runs that half (a partial run: not for bench/results)."""
    import torch
    CLOCKS.start()
    try:
        return _gpu_figures(torch, quick, layers, only)
    finally:
        CLOCKS.stop()


def _gpu_figures(torch, quick: bool, layers: int, only: str | None) -> dict:
    layers = 2 if quick else layers
    n = 200 if quick else 2000
    w1, w2, x0 = mlp_weights(torch, layers)
    weight_bytes = sum(w.numel() * w.element_size() for w in w1 + w2)
    bw = copy_gbs(torch)
    ref = reference(torch, w1, w2, x0)
    skip = {"skipped": f"--only {only}"}
    # Hops: the peers (CUDA graph, launches) and floors first, then both chains (runtime_hop.py).
    peers = section("hops", hop_figures, torch, n, repeat=5 if quick else 20) if only != "mlp" else skip
    mlp = section("mlp peers", mlp_peers, torch, w1, w2, x0, quick) if only != "hops" else skip
    CLOCKS.pause(True)          # the sampler's subprocesses would compete with the submit loop's host thread
    hops = (section("runtime tasks and submit", runtime_tasks, torch, repeat=5 if quick else 20,
                    rounds=200 if quick else 2000) if only != "mlp" else skip)
    CLOCKS.pause(False)
    variants = {name: section(f"runtime mlp {name}", runtime_mlp, torch, w1, w2, x0, repeat=3 if quick else 20,
                              variant=name) for name in (MLP_SCHEDULES if only != "hops" else ())}
    for v in variants.values():
        if "warploop_out" in v:
            v["rel_err_vs_fp32"] = rel_err(torch, v["warploop_out"], ref)
            v["replay_matches_first_run"] = bool(torch.equal(v.pop("replay_out"), v["warploop_out"]))
    # The figure is the fastest schedule whose output is right (the peer is also a best-of-configs).
    good = [v for v in variants.values()
            if v.get("rel_err_vs_fp32", float("inf")) < 0.05 and v.get("replay_matches_first_run")]
    wl = min(good, key=lambda v: v["warploop_us"]) if good else {}
    # Attribution: the best schedule's tiles with no GEMV boundaries (wrong output; never the figure).
    no_deps = (section("runtime mlp without dependencies (diagnostic)", runtime_mlp, torch, w1, w2, x0,
                       repeat=3 if quick else 20, variant=wl["variant"], deps=False)
              if wl else skip)
    floor_us = weight_bytes / (bw * 1e9) * 1e6
    stack = {"layers": layers, "weight_bytes": weight_bytes, "copy_gbs": bw, "floor_us": floor_us,
             "warploop_us": wl.get("warploop_us"), "cuda_graph_us": mlp.get("cuda_graph_us"),
             "torch_eager_us": mlp.get("torch_eager_us"), "tiles": wl.get("tiles")}
    for name, key in (("warploop", "warploop_us"), ("cuda_graph", "cuda_graph_us"), ("torch_eager", "torch_eager_us")):
        if stack[key]:
            stack[f"{name}_pct_of_floor"] = 100 * floor_us / stack[key]
    if stack["warploop_us"] and stack["cuda_graph_us"]:
        stack["speedup_vs_cuda_graph"] = stack["cuda_graph_us"] / stack["warploop_us"]
    outs = {"warploop": wl.get("warploop_out"), "cuda_graph": mlp.get("peer_out"), "torch_eager": mlp.get("eager_out")}
    stack["rel_err_vs_fp32"] = {k: rel_err(torch, v, ref) for k, v in outs.items() if v is not None}
    stack.update({k: v for k, v in wl.items() if k in ("workers", "nodes", "counters", "first_run_s")})
    stack["variants"] = {name: {k: val for k, val in v.items() if k != "warploop_out"} for name, v in variants.items()}
    stack.update({k: v for k, v in mlp.items() if k in ("per_op_configs",)})
    stack["no_dependencies_diagnostic_us"] = no_deps.get("warploop_us")
    stack["no_dependencies_diagnostic_variant"] = no_deps.get("variant")
    stack["variant"] = wl.get("variant")
    stack["clocks"] = {"peers": mlp.get("clocks"), "no_dependencies": no_deps.get("clocks"),
                       "sampler_error": CLOCKS.error}
    if "error" in mlp:
        stack["peer_error"] = mlp["error"]
    hops.pop("clocks", None)    # not sampled (paused)
    hop_peer_clocks = peers.pop("clocks", None)
    coexist = section("coexist", coexist_figures, torch) if only is None else skip
    coexist.update(section("fanout", fanout_figures, torch) if only is None else {})
    out = {"hops": n, **peers, **hops, "mlp_stack": stack, "coexist": coexist, "clocks": {"hops": hop_peer_clocks}}
    if hops.get("dependent_hop_us") and peers.get("cuda_graph_node_us"):
        out["hop_speedup_vs_cuda_graph"] = peers["cuda_graph_node_us"] / hops["dependent_hop_us"]
    return out
