"""A two-layer MLP, y = W2 silu(W1 x), as a static graph of GEMV tiles, replayed with new inputs.

Each layer is split into row tiles; every tile of layer 2 depends on every tile of layer 1, so
the graph compiler gives layer 1 one counter that layer-2 tiles wait on. The tiles are
registered with `waits=True`: each loads its first weight chunk (no predecessor needed), and
only then calls `wl.wait(ctx)` for its input activations, so weight traffic overlaps the wait.

The input is a graph parameter: each `g.run(x=...)` replays the same instructions on a new
vector, with no kernel launch and no recompilation.

    python examples/mlp_graph.py
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

import warploop
from warploop.runtime import device as wl

BN, BK = 16, 64


@triton.jit
def gemv_tile(ctx, w, x, y, n, k, row0, BN: tl.constexpr, BK: tl.constexpr, SILU: tl.constexpr):
    """y[row0:row0+BN] = act(w[row0:row0+BN, :k] @ x[:k]) for a row-major w of n rows."""
    rows = row0 + tl.arange(0, BN)
    cols = tl.arange(0, BK)
    rmask = rows < n
    first = tl.load(w + rows[:, None] * k + cols[None, :], mask=rmask[:, None] & (cols[None, :] < k), other=0.0)
    wl.wait(ctx)                           # the weights above are in flight; now x must be ready
    xv = tl.load(x + cols, mask=cols < k, other=0.0)
    acc = tl.sum(first.to(tl.float32) * xv.to(tl.float32)[None, :], axis=1)
    for k0 in range(BK, k, BK):
        c = k0 + cols
        wt = tl.load(w + rows[:, None] * k + c[None, :], mask=rmask[:, None] & (c[None, :] < k), other=0.0)
        xv = tl.load(x + c, mask=c < k, other=0.0)
        acc += tl.sum(wt.to(tl.float32) * xv.to(tl.float32)[None, :], axis=1)
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(y + rows, acc.to(y.dtype.element_ty), mask=rmask)


SIG = {"w": "*fp32", "x": "*fp32", "y": "*fp32", "n": "i32", "k": "i32", "row0": "i32"}


@warploop.task(signature=SIG, constexprs={"BN": BN, "BK": BK}, waits=True)
@triton.jit
def up_silu(ctx, w, x, y, n, k, row0, BN: tl.constexpr, BK: tl.constexpr):
    gemv_tile(ctx, w, x, y, n, k, row0, BN, BK, True)


@warploop.task(signature=SIG, constexprs={"BN": BN, "BK": BK}, waits=True)
@triton.jit
def down(ctx, w, x, y, n, k, row0, BN: tl.constexpr, BK: tl.constexpr):
    gemv_tile(ctx, w, x, y, n, k, row0, BN, BK, False)


TASKS = [up_silu, down]


def build(rt: warploop.Runtime, w1: torch.Tensor, w2: torch.Tensor, h: torch.Tensor, y: torch.Tensor):
    """Record the MLP graph: x is a parameter, weights and buffers are fixed."""
    hidden, dim = w1.shape
    g = rt.graph()
    x = g.param("x", "*fp32")
    layer1 = [g.add(up_silu, w1, x, h, hidden, dim, r) for r in range(0, hidden, BN)]
    for r in range(0, dim, BN):
        g.add(down, w2, h, y, dim, hidden, r, after=layer1)
    return g


def reference(w1: torch.Tensor, w2: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    h = w1.double() @ x.double()
    return (w2.double() @ (h * torch.sigmoid(h))).float()


def main() -> int:
    with warploop.Runtime(tasks=TASKS) as rt:
        device = "cpu" if rt.backend == "cpu" else "cuda"
        dim, hidden = (64, 128) if device == "cpu" else (1024, 4096)
        w1 = torch.randn(hidden, dim, device=device) / dim ** 0.5
        w2 = torch.randn(dim, hidden, device=device) / hidden ** 0.5
        h, y = torch.empty(hidden, device=device), torch.empty(dim, device=device)
        g = build(rt, w1, w2, h, y)
        worst = 0.0
        for _ in range(3):
            x = torch.randn(dim, device=device)
            g.run(x=x)
            ref = reference(w1, w2, x)
            worst = max(worst, float((y - ref).norm() / ref.norm()))
        print(f"{rt.backend}: {len(g)} tiles on {rt.workers} workers, 3 replays, worst relative error "
              f"{worst:.1e}: {'ok' if worst < 1e-4 else 'MISMATCH'}")
    return 0 if worst < 1e-4 else 1


if __name__ == "__main__":
    raise SystemExit(main())
