"""Dependent hop latency of static graphs, with the floors it is measured against (GPU only).

A 2000-node chain x[i] = x[i-1] + 1 as a static graph, two ways:

* **same worker**: default placement, which keeps a chain on one worker with no counter between
  hops (what a graph's own placement gives a dependent chain);
* **cross worker**: nodes pinned round robin on one-warp workers, so every hop waits on a counter
  that another SM signals.

Peers (run first: the resident kernel holds the SMs): the chain as a CUDA graph of Triton kernels
and as Triton launches from Python. Floors, from single-purpose kernels in the same process:

* `l2_round_trip_ns`: one dependent L2 hit (pointer chase, ld.global.cg, 4 MB ring of lines);
* `acquire_round_trip_ns`: the same chase with ld.acquire.gpu, the runtime's counter poll;
* `signal_one_way_ns`: two programs ping-pong one counter with the runtime's own wait (sync.wait_ge)
  and signal (barrier, release atomic): a cross-worker hop with no body;
* `signal_parts_ns`: the same ping-pong with the poll (acquire or relaxed loads) and the signal
  (release or relaxed reduction) varied, so the cost of each ordering shows: relaxed/relaxed is
  the bare transport of a value from one SM to another;
* `handwritten_cross_hop_ns`: the same ping-pong whose hop also reads the partner's value and
  writes its own (the chain's body): the best a cross-worker hop of this body can be;
* `inline_chain_hop_ns`: one program runs the whole chain, a barrier between steps: the best a
  same-worker hop of this body can be.
"""
from __future__ import annotations

import statistics

import triton
import triton.language as tl

import warploop
from warploop.bench.runtime_kernels import HOP_TASKS, hop, hop_kernel
from warploop.bench.timing import events_us, graph_of
from warploop.runtime import layout as L
from warploop.runtime.sync import i64, wait_ge

CHASE_LINES = 1 << 15       # 4 MB of 128-byte lines: L2-resident, far beyond L1
CHASE_STEPS = 20000
PING_ROUNDS = 20000


@triton.jit
def chase_kernel(ring, out, steps, ACQUIRE: tl.constexpr):
    """Follow `steps` dependent links of `ring`; out[0] = elapsed ns, out[1] = where it ended."""
    at = tl.zeros([], tl.int32)
    t0 = tl.extra.cuda.globaltimer()
    for _ in range(steps):
        if ACQUIRE:
            at = tl.inline_asm_elementwise("ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [ring + at],
                                           dtype=tl.int32, is_pure=False, pack=1)
        else:
            at = tl.load(ring + at, cache_modifier=".cg")
    t1 = tl.extra.cuda.globaltimer()
    tl.store(out, t1 - t0)
    tl.store(out + 1, at.to(tl.int64))


@triton.jit
def ping_kernel(arena, counter, data, out, rounds, WITH_DATA: tl.constexpr):
    """Programs 0 and 1 take turns: wait for the counter (sync.wait_ge), [read the partner's
    value, write one more,] barrier, release-add the counter. out[0] = ns for 2 * rounds hops."""
    pid = tl.program_id(0)
    t0 = tl.extra.cuda.globaltimer()
    for r in range(rounds):
        wait_ge(arena, counter, i64(2 * r + pid), "cuda")
        if WITH_DATA:
            tl.store(data + 1 - pid, tl.load(data + pid) + 1)
        tl.debug_barrier()
        tl.atomic_add(counter, i64(1), sem="release")
    t1 = tl.extra.cuda.globaltimer()
    if pid == 0:
        tl.store(out, t1 - t0)


# Thread 0 polls (the others wait at the barrier), as sync.POLL_ONE_THREAD without the stop word.
POLL_ASM = """{{ .reg .pred %pw, %pd; .reg .b32 %tw; mov.u32 %tw, %tid.x; mov.b64 $0, 0;
setp.ne.u32 %pw, %tw, 0; @%pw bra WL_MEET;
WL_POLL: ld.{sem}.gpu.global.b64 $0, [$1]; setp.ge.s64 %pd, $0, $2; @!%pd bra WL_POLL;
WL_MEET: barrier.sync 0; }}"""
POLL_ACQUIRE = tl.constexpr(POLL_ASM.format(sem="acquire"))
POLL_RELAXED = tl.constexpr(POLL_ASM.format(sem="relaxed"))
SIGNAL_ASM = """{{ .reg .pred %p; .reg .b32 %t; mov.u32 %t, %tid.x; setp.eq.u32 %p, %t, 0;
@%p red.{sem}.gpu.global.add.u64 [$1], 1; mov.u32 $0, 0; }}"""
SIGNAL_RELEASE = tl.constexpr(SIGNAL_ASM.format(sem="release"))
SIGNAL_RELAXED = tl.constexpr(SIGNAL_ASM.format(sem="relaxed"))


@triton.jit
def ping_parts_kernel(counter, out, rounds, ACQUIRE: tl.constexpr, RELEASE: tl.constexpr):
    """ping_kernel with the poll's and the signal's ordering chosen (inline PTX, thread 0)."""
    pid = tl.program_id(0)
    t0 = tl.extra.cuda.globaltimer()
    for r in range(rounds):
        want = i64(2 * r + pid)
        if ACQUIRE:
            tl.inline_asm_elementwise(POLL_ACQUIRE, "=l,l,l", [counter, want], dtype=tl.int64, is_pure=False, pack=1)
        else:
            tl.inline_asm_elementwise(POLL_RELAXED, "=l,l,l", [counter, want], dtype=tl.int64, is_pure=False, pack=1)
        if RELEASE:
            tl.inline_asm_elementwise(SIGNAL_RELEASE, "=r,l", [counter], dtype=tl.int32, is_pure=False, pack=1)
        else:
            tl.inline_asm_elementwise(SIGNAL_RELAXED, "=r,l", [counter], dtype=tl.int32, is_pure=False, pack=1)
    t1 = tl.extra.cuda.globaltimer()
    if pid == 0:
        tl.store(out, t1 - t0)


@triton.jit
def inline_chain_kernel(x, n, out):
    """The hop chain's body, n times in one program: x[i] = x[i-1] + 1, a barrier between steps."""
    t0 = tl.extra.cuda.globaltimer()
    for i in range(n):
        tl.store(x + i, tl.load(x + tl.maximum(i - 1, 0)) + 1)
        tl.debug_barrier()
    tl.store(out, tl.extra.cuda.globaltimer() - t0)


def _median_ns(torch, launch, out, per: int, trials: int = 5) -> float:
    samples = []
    for _ in range(trials + 1):          # the first launch compiles and warms L2
        launch()
        torch.cuda.synchronize()
        samples.append(int(out[0].item()) / per)
    return statistics.median(samples[1:])


def floors(torch, n: int) -> dict:
    """The single-purpose kernels' figures (ns), on an otherwise idle GPU."""
    lines = torch.randperm(CHASE_LINES, device="cuda", dtype=torch.int64).to(torch.int32)
    ring = torch.zeros(CHASE_LINES * 32, dtype=torch.int32, device="cuda")
    nxt = torch.roll(lines, -1)
    ring[lines.long() * 32] = nxt * 32         # one cycle through every line, in random order
    out = torch.zeros(2, dtype=torch.int64, device="cuda")
    fig = {}
    for key, acquire in (("l2_round_trip_ns", False), ("acquire_round_trip_ns", True)):
        fig[key] = _median_ns(torch, lambda a=acquire: chase_kernel[(1,)](ring, out, CHASE_STEPS, a, num_warps=1),
                              out, CHASE_STEPS)
    arena = torch.zeros(L.HEADER_WORDS + L.N_CTL * L.LINE, dtype=torch.int32, device="cuda")   # stop word 0
    counter = torch.zeros(16, dtype=torch.int64, device="cuda")
    data = torch.zeros(32, dtype=torch.int32, device="cuda")

    def ping(with_data: bool) -> None:
        counter.zero_()
        ping_kernel[(2,)](arena, counter, data, out, PING_ROUNDS, with_data, num_warps=1)

    fig["signal_one_way_ns"] = _median_ns(torch, lambda: ping(False), out, 2 * PING_ROUNDS)
    fig["handwritten_cross_hop_ns"] = _median_ns(torch, lambda: ping(True), out, 2 * PING_ROUNDS)
    fig["ping_ok"] = int(counter[0].item()) == 2 * PING_ROUNDS
    parts = {}
    for acquire in (True, False):
        for release in (True, False):
            def launch(a=acquire, r=release):
                counter.zero_()
                ping_parts_kernel[(2,)](counter, out, PING_ROUNDS, a, r, num_warps=1)
            name = f"{'acquire' if acquire else 'relaxed'}_poll_{'release' if release else 'relaxed'}_signal"
            parts[name] = _median_ns(torch, launch, out, 2 * PING_ROUNDS)
    fig["signal_parts_ns"] = parts
    x = torch.zeros(n, dtype=torch.int32, device="cuda")
    fig["inline_chain_hop_ns"] = _median_ns(torch, lambda: inline_chain_kernel[(1,)](x, n, out, num_warps=1), out, n)
    return fig


def hop_peers(torch, n: int) -> dict:
    x = torch.zeros(n, dtype=torch.int32, device="cuda")

    def chain():
        for i in range(n):
            hop_kernel[(1,)](x, i, num_warps=1)

    launch_us = events_us(torch, chain, trials=5) / n
    graph = graph_of(torch, chain, 1)
    x.zero_()
    graph.replay()
    torch.cuda.synchronize()
    ok = int(x[-1]) == n
    node_us = events_us(torch, graph.replay, reps=5) / n
    return {"triton_launch_us": launch_us, "cuda_graph_node_us": node_us, "cuda_graph_chain_ok": ok}


def chain(rt, x, n: int, pinned: bool):
    """The hop chain as a graph: default placement, or pinned round robin on every worker."""
    g = rt.graph()
    prev = []
    for i in range(n):
        prev = [g.add(hop, x, i, after=prev, worker=i % rt.workers if pinned else None)]
    return g


def time_chain(torch, g, x, n: int, repeat: int) -> dict:
    """Median device time per hop over 5 requests of `repeat` runs, and whether x is right after."""
    g.run(timeout=30)
    per_hop = []
    for _ in range(5):
        f = g.launch(repeat=repeat)
        f.result(timeout=30)
        per_hop.append(f.device_ns / 1e3 / (repeat * n))
    runs = 1 + 5 * repeat
    expect = torch.arange(n, dtype=torch.int32) + runs
    workers = set(g.schedule.worker_of)
    return {"us": statistics.median(per_hop), "samples_us": per_hop, "ok": bool(torch.equal(x.cpu(), expect)),
            "workers_used": len(workers), "counters": len(g.schedule.counter_sizes)}


def hop_figures(torch, n: int = 2000, repeat: int = 20) -> dict:
    """Every figure of this file; peers and floors first, then one runtime for both chains."""
    fig = {"hops": n, **floors(torch, n), **hop_peers(torch, n)}
    workers = torch.cuda.get_device_properties(0).multi_processor_count
    x_same = torch.zeros(n, dtype=torch.int32, device="cuda")
    x_cross = torch.zeros(n, dtype=torch.int32, device="cuda")
    with warploop.Runtime(device="cuda", tasks=HOP_TASKS, workers=workers, worker_warps=1) as rt:
        same = time_chain(torch, chain(rt, x_same, n, pinned=False), x_same, n, repeat)
        cross = time_chain(torch, chain(rt, x_cross, n, pinned=True), x_cross, n, repeat)
        fig["hop_runtime_workers"] = rt.workers
    fig.update({"dependent_hop_us": same["us"], "dependent_hop_ok": same["ok"], "dependent_hop_detail": same,
                "cross_worker_hop_us": cross["us"], "cross_worker_hop_ok": cross["ok"],
                "cross_worker_hop_detail": cross})
    node = fig["cuda_graph_node_us"]
    fig["dependent_hop_speedup_vs_cuda_graph"] = node / same["us"]
    fig["cross_worker_hop_speedup_vs_cuda_graph"] = node / cross["us"]
    fig["dependent_hop_l2_round_trips"] = same["us"] * 1e3 / fig["l2_round_trip_ns"]
    fig["cross_worker_hop_l2_round_trips"] = cross["us"] * 1e3 / fig["l2_round_trip_ns"]
    return fig


def main() -> int:
    import json
    import sys

    import torch
    fig = hop_figures(torch, int(sys.argv[1]) if len(sys.argv) > 1 else 2000)
    print(json.dumps(fig, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
