"""How a persistent GEMV should stream its weights: the megakernel's batch-1 tile pattern against
cross-tile pipelining, outside the runtime, one process, one GPU.

    PYTHONPATH=$PWD python scripts/gemv_patterns.py [--json out.json]

Each variant is a persistent grid of P programs (4 warps) walking tiles t = pid, pid + P, ...
of a bf16 weight matrix [N, K] times x [K] -> float32 out [N]:

- tile:     the megakernel's form: a tile's chunks all issued, then x, products, one reduction,
            the store; the next tile's loads only after that (num_stages=1: no pipelining).
- pipe S:   the same loop compiled with num_stages=S: Triton's pipeliner may copy the next
            tiles into shared memory while this one is reduced (the PTX is checked for cp.async).
- regdb:    two register tiles, the next one's loads issued before this one's products.

Peers in the same run: torch.mv (cuBLAS) and a device copy (the bandwidth the floor uses).
Weights rotate over several copies so that L2 holds none of them.
"""
from __future__ import annotations

import argparse
import itertools
import json

import torch
import triton
import triton.language as tl

from warploop.bench.runtime_gpu import copy_gbs, events_us
from warploop.llm.mk.gemv_tile import gemv_tile


@triton.jit
def _tile_dot(w, x, row0, N, K: tl.constexpr, TN: tl.constexpr, TK: tl.constexpr):
    NC: tl.constexpr = K // TK
    rows = row0 + tl.arange(0, TN)
    cols = tl.arange(0, TK)
    acc = tl.zeros([TN, TK], tl.float32)
    for c in tl.static_range(NC):
        v = tl.load(w + rows.to(tl.int64)[:, None] * K + (c * TK + cols)[None, :], mask=(rows < N)[:, None],
                    other=0.0, eviction_policy="evict_first")
        xv = tl.load(x + c * TK + cols)
        acc += v.to(tl.float32) * xv.to(tl.float32)[None, :]
    return tl.sum(acc, axis=1)


@triton.jit
def tile_kernel(w, x, out, N, P, K: tl.constexpr, TN: tl.constexpr, TK: tl.constexpr):
    pid = tl.program_id(0)
    ntiles = tl.cdiv(N, TN)
    for t in range(pid, ntiles, P):
        rows = t * TN + tl.arange(0, TN)
        tl.store(out + rows, _tile_dot(w, x, t * TN, N, K, TN, TK), mask=rows < N)


@triton.jit
def _load_tile(w, row0, N, K: tl.constexpr, TN: tl.constexpr):
    rows = row0 + tl.arange(0, TN)
    cols = tl.arange(0, K)
    return tl.load(w + rows.to(tl.int64)[:, None] * K + cols[None, :], mask=(rows < N)[:, None], other=0.0,
                   eviction_policy="evict_first")


@triton.jit
def _finish(a, x, out, row0, N, K: tl.constexpr, TN: tl.constexpr):
    rows = row0 + tl.arange(0, TN)
    xv = tl.load(x + tl.arange(0, K)).to(tl.float32)
    tl.store(out + rows, tl.sum(a.to(tl.float32) * xv[None, :], axis=1), mask=rows < N)


@triton.jit
def regdb_kernel(w, x, out, N, P, K: tl.constexpr, TN: tl.constexpr):
    """Two tiles in registers: tile t + P's loads go out before tile t's products."""
    pid = tl.program_id(0)
    ntiles = tl.cdiv(N, TN)
    a = _load_tile(w, pid * TN, N, K, TN)
    for t in range(pid, ntiles, 2 * P):
        b = _load_tile(w, (t + P) * TN, N, K, TN)
        _finish(a, x, out, t * TN, N, K, TN)
        a = _load_tile(w, (t + 2 * P) * TN, N, K, TN)
        _finish(b, x, out, (t + P) * TN, N, K, TN)


@triton.jit
def mk_body_kernel(ctx, inp, w, x, norm_w, out, N, f, P, NORM: tl.constexpr, EPI: tl.constexpr, K: tl.constexpr,
                   TN: tl.constexpr, TK: tl.constexpr, R: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """The megakernel's own GEMV tile body (gemv_tile: its norm, epilogue and batch path compiled in),
    outside the runtime: no instruction fetch, no wait, no signal."""
    pid = tl.program_id(0)
    for t in range(pid, tl.cdiv(N, TN), P):
        gemv_tile(ctx, inp, w, w, x, norm_w, out, N, f, t * TN, TN, 1e-5, 0, NORM, EPI, K, TN, TK, 8, R, BN, BK,
                  0, "cuda")


def rotating_us(fn, ws, before=(), after=(), **kw) -> float:
    """Device µs per call fn(*before, w, *after, **kw), w cycling over the weight copies ws (so L2
    holds none of them)."""
    it = itertools.cycle(ws)
    return events_us(torch, lambda: fn(*before, next(it), *after, **kw), reps=30)


def mk_bodies(dev, sms: int, bw: float, per: int) -> dict:
    """The megakernel's tile body on Llama-3.2-1B's gate_up (norm, SiLU) and down shapes, and plain."""
    from warploop.llm.mk.gemv import EPI_OUT, EPI_SILU
    from warploop.llm.mk.layout import D_ROWS, Plan
    from warploop.runtime import layout as L
    plan = Plan(dtype="bf16", heads=32, kv_heads=8, head_dim=64, block_size=16, hidden=2048, inter=8192, depth=8,
                tile_kb=64)
    ctx = torch.zeros(64, dtype=torch.int32, device=dev)
    ctx[L.X_WAIT:L.X_WAIT + 2] = -1
    inp = torch.zeros(64, dtype=torch.int32, device=dev)
    inp[int(D_ROWS)] = 1
    p = sms * per
    rows = {}
    for name, n, k, norm, epi, sub in (("plain 16384x2048", 16384, 2048, False, EPI_OUT, 1),
                                       ("norm 16384x2048", 16384, 2048, True, EPI_OUT, 1),
                                       ("norm+silu gate_up 2x8192x2048", 8192, 2048, True, EPI_SILU, 2),
                                       ("down 2048x8192", 2048, 8192, False, EPI_OUT, 1)):
        tn, tk = plan.gemv_tile(k, sub)
        copies = 3
        ws = [torch.randn(n * sub, k, device=dev, dtype=torch.bfloat16) / 16 for _ in range(copies)]
        x = torch.randn(k, device=dev, dtype=torch.bfloat16)
        nw = torch.rand(k, device=dev, dtype=torch.bfloat16) + 0.5
        out = torch.full((n,), float("nan"), device=dev, dtype=torch.bfloat16)
        xr = x.double()
        if norm:
            xr = xr * torch.rsqrt(xr.pow(2).mean() + 1e-5) * nw.double()
        y = ws[0].double() @ xr
        ref = torch.nn.functional.silu(y[:n]) * y[n:] if sub == 2 else y
        args = dict(NORM=norm, EPI=epi, K=k, TN=tn, TK=tk, R=plan.rows, BN=plan.bn, BK=plan.bk, num_warps=4,
                    num_stages=1)
        try:
            h = mk_body_kernel[(p,)](ctx, inp, ws[0], x, nw, out, n, n, p, **args)
            torch.cuda.synchronize()
            err = float((out.double() - ref).norm() / ref.norm())
            us = rotating_us(mk_body_kernel[(p,)], ws, (ctx, inp), (x, nw, out, n, n, p), **args)
            floor = n * sub * k * 2 / bw / 1e3
            rows[f"mk-{name}-{per}ps"] = {"us": round(us, 2), "floor_us": round(floor, 2),
                                          "of_floor": round(floor / us, 3), "rel_err": err, "regs": h.n_regs,
                                          "spills": h.n_spills, "TN": tn, "TK": tk}
        except Exception as e:  # noqa: BLE001
            rows[f"mk-{name}-{per}ps"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        print(name, rows[f"mk-{name}-{per}ps"], flush=True)
        del ws
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["16384x2048", "2048x8192"], help="N x K of the weights")
    ap.add_argument("--programs", nargs="+", type=int, default=[1, 2, 3, 4], help="programs per SM")
    ap.add_argument("--tile-kb", nargs="+", type=int, default=[16, 32, 64])
    ap.add_argument("--json", default=None)
    ap.add_argument("--mk", action="store_true", help="only the megakernel's own tile body (gemv_tile)")
    args = ap.parse_args()
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    results = []
    bw = copy_gbs(torch)                            # GB/s, bytes read + written
    print(json.dumps({"device": torch.cuda.get_device_name(dev), "sms": sms, "copy_GBps": round(bw),
                      "torch": torch.__version__, "triton": triton.__version__}), flush=True)
    if args.mk:
        mk = {}
        for per in (2, 3):
            mk.update(mk_bodies(dev, sms, bw, per))
        print("\nmegakernel tile body (Llama-3.2-1B tiles of 64 KB)")
        for key, v in mk.items():
            print(f"   {key:42s} {v}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(mk, f, indent=1)
        return
    for shape in args.shapes:
        n, k = (int(v) for v in shape.split("x"))
        copies = max(3, -(-150 * 2**20 // (n * k * 2)))
        ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) for _ in range(copies)]
        x = torch.randn(k, device=dev, dtype=torch.bfloat16)
        ref = ws[0].double() @ x.double()
        floor_us = n * k * 2 / bw / 1e3
        peer = rotating_us(torch.mv, ws, (), (x,))
        row = {"shape": shape, "MB": round(n * k * 2 / 2**20, 1), "floor_us": round(floor_us, 2),
               "torch_mv_us": round(peer, 2), "variants": {}}
        for kb in args.tile_kb:
            tn = max(1, kb * 1024 // (2 * k))
            tk = min(k, 256)
            if tn < 1 or tn & (tn - 1):
                continue
            for per in args.programs:
                p = sms * per
                out = torch.empty(n, device=dev, dtype=torch.float32)
                forms = [("tile", dict(num_stages=1), tile_kernel, (k, tn, tk)),
                         ("pipe2", dict(num_stages=2), tile_kernel, (k, tn, tk)),
                         ("pipe3", dict(num_stages=3), tile_kernel, (k, tn, tk))]
                if kb <= 32:
                    forms.append(("regdb", dict(num_stages=1), regdb_kernel, (k, tn)))
                for name, opts, kern, consts in forms:
                    key = f"{name}-{kb}kb-{per}ps"
                    try:
                        out.fill_(float("nan"))
                        h = kern[(p,)](ws[0], x, out, n, p, *consts, num_warps=4, **opts)
                        torch.cuda.synchronize()
                        err = float((out.double() - ref).norm() / ref.norm())
                        ptx = h.asm.get("ptx", "")
                        us = rotating_us(kern[(p,)], ws, (), (x, out, n, p, *consts), num_warps=4, **opts)
                        row["variants"][key] = {"us": round(us, 2), "of_floor": round(floor_us / us, 3),
                                                "vs_torch": round(peer / us, 3), "rel_err": err,
                                                "cp_async": "cp.async" in ptx, "regs": h.n_regs,
                                                "spills": h.n_spills, "smem": h.metadata.shared}
                    except Exception as e:  # noqa: BLE001 - a variant that does not compile is a result
                        row["variants"][key] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
                    print(key, shape, row["variants"][key], flush=True)
        results.append(row)
        del ws
    print("\nshape       variant              us   of-floor  vs-torch.mv  err")
    for row in results:
        print(f"{row['shape']}  floor {row['floor_us']} us, torch.mv {row['torch_mv_us']} us")
        for key, v in sorted(row["variants"].items(), key=lambda kv: kv[1].get("us", 1e9)):
            if "us" in v:
                print(f"   {key:22s} {v['us']:8.2f} {v['of_floor']:8.3f} {v['vs_torch']:8.3f}  {v['rel_err']:.1e}"
                      f"  regs {v['regs']} spills {v['spills']} smem {v['smem']} cp.async {v['cp_async']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
