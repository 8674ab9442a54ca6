"""Does a worker's share of a GEMV stage stream better as one pipelined chunk loop through shared
memory than as the megakernel's register tiles, once stages depend on each other?

    PYTHONPATH=$PWD python scripts/gemv_share.py [--json out.json]

Outside the runtime, one persistent kernel of P programs (4 warps, 2 an SM by default) runs L
layers of two dependent GEMV stages with Llama-3.2-1B's widths: a [16384, 2048] stage (gate_up's
bytes) whose output's first 8192 values are the next stage's x, then [2048, 8192] (down), whose
output is the next layer's x. Between stages every program signals a counter (release) and waits
for all P (acquire): the dependency the megakernel's counters give, without its dispatch. Every
layer has weights of its own (L x 96 MB: L2 holds none).

Forms of a program's share of a stage (tiles t = pid, pid + P, ...):
- tile:  the megakernel's batch-1 form (gemv_tile's pattern): a tile's chunks (at most 8, 64 KB)
         in registers, the first tile's issued before the wait, the next tile's only after this
         one's products and store.
- dot S: the share as one flat loop over (tile, chunk), x broadcast to 16 rows through tl.dot,
         compiled with num_stages=S: Triton's pipeliner copies the next S - 1 chunks into shared
         memory (cp.async) while this one is multiplied, across tile boundaries. The wait comes
         before the loop (x must not be read early), so no weights are in flight during it. The
         second stage takes TN 16 (tl.dot's least): 128 tiles for down's 2,048 rows.

Peers in the same run: a device copy (the floor's bandwidth). Device time by CUDA events, median.
"""
from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl

from warploop.bench.runtime_gpu import copy_gbs, events_us
from warploop.llm.mk.gemv import EPI_RES, EPI_SILU
from warploop.llm.mk.gemv_tile import gemv_tile
from warploop.runtime import layout as RL
from warploop.runtime.sync import p64

SPIN = 1 << 22      # polls before a stage wait gives up (flags an error instead of hanging)


@triton.jit
def stage_wait(cnt, s, P, err):
    """Spin until all P programs signalled stage s (acquire), or flag err after SPIN polls."""
    if s >= 0:
        n = tl.atomic_add(cnt + s, 0, sem="acquire")
        polls = 0
        while (n < P) & (polls < 4194304):
            n = tl.atomic_add(cnt + s, 0, sem="acquire")
            polls += 1
        if n < P:
            tl.atomic_xchg(err, 1)


@triton.jit
def stage_signal(cnt, s):
    tl.debug_barrier()
    tl.atomic_add(cnt + s, 1, sem="release")


@triton.jit
def tile_load(w, t, c: tl.constexpr, K: tl.constexpr, TN: tl.constexpr, TK: tl.constexpr):
    rows = t * TN + tl.arange(0, TN)
    cols = c * TK + tl.arange(0, TK)
    return tl.load(w + rows.to(tl.int64)[:, None] * K + cols[None, :], eviction_policy="evict_first")


@triton.jit
def tile_finish(a, x, c: tl.constexpr, acc, TK: tl.constexpr):
    """acc plus chunk c's products (a: the chunk's weights, already in registers)."""
    xv = tl.load(x + c * TK + tl.arange(0, TK)).to(tl.float32)
    return acc + a.to(tl.float32) * xv[None, :]


@triton.jit
def tile_stage(w, x, y, cnt, s, pid, P, err, N: tl.constexpr, K: tl.constexpr, TN: tl.constexpr,
               TK: tl.constexpr):
    """The register-tile form: up to 8 chunks a tile, all in flight, the first tile's before the wait."""
    NC: tl.constexpr = K // TK
    tl.static_assert(NC <= 8)
    first = pid >= 0                # True, as a run-time value (loop-carried)
    for t in range(pid, N // TN, P):
        a0 = tile_load(w, t, 0, K, TN, TK)
        a1 = a0
        a2 = a0
        a3 = a0
        a4 = a0
        a5 = a0
        a6 = a0
        a7 = a0
        if NC > 1:
            a1 = tile_load(w, t, 1, K, TN, TK)
        if NC > 2:
            a2 = tile_load(w, t, 2, K, TN, TK)
        if NC > 3:
            a3 = tile_load(w, t, 3, K, TN, TK)
        if NC > 4:
            a4 = tile_load(w, t, 4, K, TN, TK)
        if NC > 5:
            a5 = tile_load(w, t, 5, K, TN, TK)
        if NC > 6:
            a6 = tile_load(w, t, 6, K, TN, TK)
        if NC > 7:
            a7 = tile_load(w, t, 7, K, TN, TK)
        if first:
            stage_wait(cnt, s - 1, P, err)
            first = pid < 0
        acc = tl.zeros([TN, TK], tl.float32)
        acc = tile_finish(a0, x, 0, acc, TK)
        if NC > 1:
            acc = tile_finish(a1, x, 1, acc, TK)
        if NC > 2:
            acc = tile_finish(a2, x, 2, acc, TK)
        if NC > 3:
            acc = tile_finish(a3, x, 3, acc, TK)
        if NC > 4:
            acc = tile_finish(a4, x, 4, acc, TK)
        if NC > 5:
            acc = tile_finish(a5, x, 5, acc, TK)
        if NC > 6:
            acc = tile_finish(a6, x, 6, acc, TK)
        if NC > 7:
            acc = tile_finish(a7, x, 7, acc, TK)
        rows = t * TN + tl.arange(0, TN)
        tl.store(y + rows, tl.sum(acc, axis=1).to(y.dtype.element_ty))
    if first:
        stage_wait(cnt, s - 1, P, err)
    stage_signal(cnt, s)


@triton.jit
def dot_stage(w, x, y, cnt, s, pid, P, err, N: tl.constexpr, K: tl.constexpr, TN: tl.constexpr,
              TK: tl.constexpr, S: tl.constexpr):
    """The share as one flat chunk loop, pipelined S deep through shared memory by Triton."""
    NC: tl.constexpr = K // TK
    ntiles: tl.constexpr = N // TN
    mine = tl.maximum((ntiles - pid + P - 1) // P, 0)
    stage_wait(cnt, s - 1, P, err)
    rn = tl.arange(0, TN)
    ck = tl.arange(0, TK)
    r16 = tl.arange(0, 16)
    acc = tl.zeros([16, TN], tl.float32)
    for j in tl.range(0, mine * NC, num_stages=S):
        t = pid + (j // NC) * P
        c = j % NC
        wv = tl.load(w + (t * TN + rn).to(tl.int64)[:, None] * K + (c * TK + ck)[None, :])
        xv = tl.load(x + c * TK + ck[None, :] + 0 * r16[:, None])
        acc = tl.dot(xv, tl.trans(wv), tl.where(c == 0, 0.0, acc))
        if c == NC - 1:
            tl.store(y + t * TN + rn[None, :] + 0 * r16[:, None], acc.to(y.dtype.element_ty),
                     mask=(r16 == 0)[:, None])
    stage_signal(cnt, s)


@triton.jit
def mk_stage(ctx, inp, w, x, norm_w, out, cnt64, s, pid, P, N_OUT: tl.constexpr, F: tl.constexpr,
             NORM: tl.constexpr, EPI: tl.constexpr, K: tl.constexpr, TN: tl.constexpr, TK: tl.constexpr,
             R: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, ONE: tl.constexpr):
    """The megakernel's own tile body (gemv_tile: norm, SiLU or residual epilogue, the batch path
    unless ONE), waiting through the runtime's wl.wait on int64 counters as a graph node does: the
    first tile of a stage waits for every program's signal of the stage before, the rest skip it
    (the runtime's stage runs), and the share signals once at its end."""
    first = pid >= 0
    for t in range(pid, (N_OUT + TN - 1) // TN, P):
        c = tl.where(first & (s > 0), s - 1, -1)
        tl.store(ctx + RL.X_WAIT, c)
        tl.store(ctx + RL.X_WAIT + 1, -1)
        tl.store(p64(ctx + RL.X_WAIT_TARGET), P.to(tl.int64))
        tl.debug_barrier()
        gemv_tile(ctx, inp, w, w, x, norm_w, out, N_OUT, F, t * TN, TN, 1e-5, 0, NORM, EPI, K, TN, TK, 8, R, BN,
                  BK, ONE, "cuda")
        first = pid < 0
    if first & (s > 0):
        stage_wait64(cnt64, s - 1, P)
    tl.debug_barrier()
    tl.atomic_add(cnt64 + s, 1, sem="release")


@triton.jit
def stage_wait64(cnt64, s, P):
    n = tl.atomic_add(cnt64 + s, 0, sem="acquire")
    while n < P:
        n = tl.atomic_add(cnt64 + s, 0, sem="acquire")


@triton.jit
def mk_layers_kernel(arena, inp, wa, wb, nw, resid, act, cnt64, P, L: tl.constexpr, KA: tl.constexpr,
                     FF: tl.constexpr, TNA: tl.constexpr, TKA: tl.constexpr, TNB: tl.constexpr, TKB: tl.constexpr,
                     R: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, ONE: tl.constexpr):
    """L layers of gate_up (RMSNorm fused, SiLU) and down (residual add) through gemv_tile."""
    pid = tl.program_id(0)
    ctx = arena + RL.CTX_BASE + pid * RL.CTX_WORDS
    tl.store(ctx + RL.X_WORKER, pid)
    tl.store(p64(ctx + RL.X_COUNTERS), cnt64.to(tl.int64))
    for layer in range(L):
        w1 = wa + layer.to(tl.int64) * 2 * FF * KA
        w2 = wb + layer.to(tl.int64) * FF * KA
        mk_stage(ctx, inp, w1, resid, nw + layer * KA, act + layer * FF, cnt64, 2 * layer, pid, P, FF, FF, True,
                 EPI_SILU, KA, TNA, TKA, R, BN, BK, ONE)
        mk_stage(ctx, inp, w2, act + layer * FF, nw, resid, cnt64, 2 * layer + 1, pid, P, KA, KA, False, EPI_RES,
                 FF, TNB, TKB, R, BN, BK, ONE)


@triton.jit
def layers_kernel(wa, wb, x0, ya, yb, cnt, err, P, L: tl.constexpr, FORM: tl.constexpr,
                  NA: tl.constexpr, KA: tl.constexpr, NB: tl.constexpr, KB: tl.constexpr,
                  TNA: tl.constexpr, TKA: tl.constexpr, TNB: tl.constexpr, TKB: tl.constexpr, S: tl.constexpr):
    pid = tl.program_id(0)
    x = x0
    for layer in range(L):
        w1 = wa + layer.to(tl.int64) * NA * KA
        w2 = wb + layer.to(tl.int64) * NB * KB
        y1 = ya + layer * NA
        y2 = yb + layer * NB
        if FORM == 0:
            tile_stage(w1, x, y1, cnt, 2 * layer, pid, P, err, NA, KA, TNA, TKA)
            tile_stage(w2, y1, y2, cnt, 2 * layer + 1, pid, P, err, NB, KB, TNB, TKB)
        else:
            dot_stage(w1, x, y1, cnt, 2 * layer, pid, P, err, NA, KA, TNA, TKA, S)
            dot_stage(w2, y1, y2, cnt, 2 * layer + 1, pid, P, err, NB, KB, TNB, TKB, S)
        x = y2


def reference(wa, wb, x0, L):
    x = x0.double()
    y = x
    for layer in range(L):
        ya = (wa[layer].double() @ x).to(torch.bfloat16).double()
        y = (wb[layer].double() @ ya[:wb.shape[2]]).to(torch.bfloat16).double()
        x = y[:wa.shape[2]]
    return y


def mk_reference(wa, wb, nw, r0, L):
    bf = torch.bfloat16
    r = r0.double()
    ff = wb.shape[2]
    for layer in range(L):
        rstd = torch.rsqrt(r.pow(2).mean() + 1e-5)
        h = ((r * rstd).to(bf).double() * nw[layer].double()).to(bf).double()
        y = wa[layer].double() @ h
        g, u = y[:ff].to(bf).double(), y[ff:].to(bf).double()
        a = (torch.nn.functional.silu(g).to(bf).double() * u).to(bf).double()
        r = (r + (wb[layer].double() @ a).to(bf).double()).to(bf).double()
    return r


def mk_forms(args, dev, sms, bw, L, forms) -> dict:
    """The megakernel's tile body, Llama-3.2-1B's gate_up (norm, SiLU) and down (residual) widths."""
    from warploop.llm.mk.layout import D_ROWS, Plan
    plan = Plan(dtype="bf16", heads=32, kv_heads=8, head_dim=64, block_size=16, hidden=2048, inter=8192, depth=8,
                tile_kb=64)
    KA, FF = 2048, 8192
    tna, tka = plan.gemv_tile(KA, 2)
    tnb, tkb = plan.gemv_tile(FF, 1)
    g = torch.Generator(device=dev).manual_seed(1)
    wa = (torch.randn(L, 2 * FF, KA, device=dev, generator=g) / 45).to(torch.bfloat16)
    wb = (torch.randn(L, KA, FF, device=dev, generator=g) / 90).to(torch.bfloat16)
    nw = (torch.rand(L, KA, device=dev, generator=g) + 0.5).to(torch.bfloat16)
    r0 = torch.randn(KA, device=dev, generator=g).to(torch.bfloat16)
    resid = r0.clone()
    act = torch.empty(L, FF, device=dev, dtype=torch.bfloat16)
    cnt64 = torch.zeros(2 * L, device=dev, dtype=torch.int64)
    inp = torch.zeros(64, device=dev, dtype=torch.int32)
    inp[int(D_ROWS)] = 1
    ref = mk_reference(wa, wb, nw, r0, L)
    floor_us = L * 3 * FF * KA * 2 / bw / 1e3
    rows = {}
    for form in forms:
        for per in args.per_sm:
            P = sms * per
            arena = torch.zeros(RL.CTX_BASE + (P + 1) * RL.CTX_WORDS, device=dev, dtype=torch.int32)
            consts = dict(L=L, KA=KA, FF=FF, TNA=tna, TKA=tka, TNB=tnb, TKB=tkb, R=plan.rows, BN=plan.bn,
                          BK=plan.bk, ONE=1 if form == "mk-nobatch" else 0)
            key = f"{form}-{per}ps"

            def reset():
                cnt64.zero_()
                resid.copy_(r0)

            def run(P=P, arena=arena, consts=consts):
                reset()
                mk_layers_kernel[(P,)](arena, inp, wa, wb, nw, resid, act, cnt64, P, num_warps=4, **consts)
            try:
                run()
                torch.cuda.synchronize()
                rel = float((resid.double() - ref).norm() / ref.norm())
                h = mk_layers_kernel.warmup(arena, inp, wa, wb, nw, resid, act, cnt64, P, num_warps=4, grid=(P,),
                                            **consts)
                us = events_us(torch, run, reps=5) - events_us(torch, reset, reps=5)
                rows[key] = {"us": round(us, 1), "of_floor": round(floor_us / us, 3), "rel_err": rel,
                             "regs": h.n_regs, "spills": h.n_spills, "smem": h.metadata.shared,
                             "tiles": [tna, tka, tnb, tkb]}
            except Exception as e:  # noqa: BLE001
                rows[key] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            print(key, json.dumps(rows[key]), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--per-sm", nargs="+", type=int, default=[2])
    ap.add_argument("--forms", nargs="+", default=["mk", "mk-nobatch", "tile", "dot:16:256:3", "dot:16:256:4",
                                                    "dot:32:256:4", "dot:16:512:4", "dot:32:512:3", "dot:64:256:3"],
                    help="mk (the megakernel's tile body), mk-nobatch (its batch path left out), tile, "
                         "or dot:TN:TK:S")
    ap.add_argument("--b-shape", default="2048x8192", help="the second stage's N x K (down's by default)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    L, NA, KA = args.layers, 16384, 2048
    NB, KB = (int(v) for v in args.b_shape.split("x"))
    bw = copy_gbs(torch)
    head = {"device": torch.cuda.get_device_name(dev), "sms": sms, "copy_GBps": round(bw),
            "torch": torch.__version__, "triton": triton.__version__, "layers": L, "b_shape": args.b_shape}
    print(json.dumps(head), flush=True)
    g = torch.Generator(device=dev).manual_seed(0)
    wa = (torch.randn(L, NA, KA, device=dev, generator=g) / 45).to(torch.bfloat16)
    wb = (torch.randn(L, NB, KB, device=dev, generator=g) / 90).to(torch.bfloat16)
    x0 = torch.randn(KA, device=dev, generator=g).to(torch.bfloat16)
    ya = torch.empty(L, NA, device=dev, dtype=torch.bfloat16)
    yb = torch.empty(L, NB, device=dev, dtype=torch.bfloat16)
    cnt = torch.zeros(2 * L, device=dev, dtype=torch.int32)
    err = torch.zeros(1, device=dev, dtype=torch.int32)
    ref = reference(wa, wb, x0, L)
    floor_us = L * (NA * KA + NB * KB) * 2 / bw / 1e3
    rows = {}
    if any(f.startswith("mk") for f in args.forms):
        rows.update(mk_forms(args, dev, sms, bw, L, [f for f in args.forms if f.startswith("mk")]))
    for form in [f for f in args.forms if not f.startswith("mk")]:
        for per in args.per_sm:
            P = sms * per
            if form == "tile":
                consts = dict(FORM=0, TNA=16, TKA=256, TNB=32768 // KB, TKB=KB // 8, S=1)
            else:
                _, tn, tk, st = form.split(":")
                consts = dict(FORM=1, TNA=int(tn), TKA=int(tk), TNB=16, TKB=int(tk), S=int(st))   # down: 16 rows a tile
            key = f"{form}-{per}ps"

            def run(P=P, consts=consts):
                cnt.zero_()
                layers_kernel[(P,)](wa, wb, x0, ya, yb, cnt, err, P, L=L, NA=NA, KA=KA, NB=NB, KB=KB,
                                    num_warps=4, num_stages=1, **consts)
            try:
                yb.fill_(float("nan"))
                err.zero_()
                run()
                torch.cuda.synchronize()
                rel = float((yb[-1].double() - ref).norm() / ref.norm())
                h = layers_kernel.warmup(wa, wb, x0, ya, yb, cnt, err, P, L=L, NA=NA, KA=KA, NB=NB, KB=KB,
                                         num_warps=4, num_stages=1, grid=(P,), **consts)
                us = events_us(torch, run, reps=5)
                zero_us = events_us(torch, cnt.zero_, reps=5)
                us -= zero_us
                rows[key] = {"us": round(us, 1), "of_floor": round(floor_us / us, 3), "rel_err": rel,
                             "timeouts": int(err.item()), "regs": h.n_regs, "spills": h.n_spills,
                             "smem": h.metadata.shared, "cp_async": "cp.async" in h.asm.get("ptx", "")}
            except Exception as e:  # noqa: BLE001 - a form that does not compile or fit is a result
                rows[key] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            print(key, json.dumps(rows[key]), flush=True)
    print(f"\nfloor {floor_us:.1f} us ({L} layers, {L * (NA * KA + NB * KB) * 2 / 1e6:.0f} MB at {bw:.0f} GB/s)")
    for key, v in sorted(rows.items(), key=lambda kv: kv[1].get("us", 1e9)):
        print(f"  {key:24s} {json.dumps(v)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**head, "floor_us": floor_us, "forms": rows}, f, indent=1)


if __name__ == "__main__":
    main()
