"""Tasks and peer kernels for `warploop bench runtime`: the same bodies run as runtime tasks and as
ordinary Triton kernels (launched one by one, or captured in a CUDA graph), so the comparisons
measure scheduling, not different code.
"""
from __future__ import annotations

import triton
import triton.language as tl

import warploop
from warploop.runtime import device as wl


# -- dependent hops and tiny tasks ----------------------------------------------------------------
@warploop.task(signature={"x": "*i32", "i": "i32"})
@triton.jit
def hop(x, i):
    """x[i] = x[i-1] + 1 (x[0] += 1): each step reads what the step before wrote."""
    tl.store(x + i, tl.load(x + tl.maximum(i - 1, 0)) + 1)


@triton.jit
def hop_kernel(x, i):
    hop(x, i)


@warploop.task(signature={"x": "*i32"})
@triton.jit
def tick(x):
    tl.atomic_add(x, 1, sem="relaxed")


@warploop.task(signature={})
@triton.jit
def noop():
    pass


@warploop.task(signature={"x": "*i32", "n": "i32"})
@triton.jit
def spawn_ticks(ctx, x, n):
    for _ in range(n):
        wl.spawn(ctx, tick, x)


@warploop.task(signature={"x": "*i32", "fan": "i32", "n": "i32"})
@triton.jit
def spawn_tree(ctx, x, fan, n):
    """fan spawners of n ticks each: spawning and running spread over every worker."""
    for _ in range(fan):
        wl.spawn(ctx, spawn_ticks, x, n)


HOP_TASKS = [hop, tick, noop, spawn_ticks, spawn_tree]


# -- the MLP stack: bf16 GEMV tiles ------------------------------------------------------------------
@triton.jit
def gemv_rows(w, x, y, k, row0, BN: tl.constexpr, BK: tl.constexpr, SILU: tl.constexpr, ctx, WAIT: tl.constexpr):
    """y[row0:row0+BN] = act(w[row0:row0+BN, :] @ x) for row-major bf16 w with k columns (k % BK == 0).

    With WAIT, the first weight chunk is issued before waiting for x (weights need no predecessor).
    """
    rows = row0 + tl.arange(0, BN)
    cols = tl.arange(0, BK)
    tile = w + rows[:, None] * k + cols[None, :]
    first = tl.load(tile, eviction_policy="evict_first")
    if WAIT:
        wl.wait(ctx)
    acc = tl.sum(first.to(tl.float32) * tl.load(x + cols).to(tl.float32)[None, :], axis=1)
    for k0 in range(BK, k, BK):
        wt = tl.load(tile + k0, eviction_policy="evict_first")
        acc += tl.sum(wt.to(tl.float32) * tl.load(x + k0 + cols).to(tl.float32)[None, :], axis=1)
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(y + rows, acc.to(tl.bfloat16))


UP = {"BN": 16, "BK": 512}       # 2048 -> 8192: 512 tiles of 16 rows
DOWN = {"BN": 4, "BK": 2048}     # 8192 -> 2048: 512 tiles of 4 rows
MLP_SIG = {"w": "*bf16", "x": "*bf16", "y": "*bf16", "k": "i32", "row0": "i32"}


@warploop.task(signature=MLP_SIG, constexprs=UP, waits=True, cost=1.0)
@triton.jit
def mlp_up(ctx, w, x, y, k, row0, BN: tl.constexpr, BK: tl.constexpr):
    gemv_rows(w, x, y, k, row0, BN, BK, True, ctx, True)


@warploop.task(signature=MLP_SIG, constexprs=DOWN, waits=True, cost=1.0)
@triton.jit
def mlp_down(ctx, w, x, y, k, row0, BN: tl.constexpr, BK: tl.constexpr):
    gemv_rows(w, x, y, k, row0, BN, BK, False, ctx, True)


MLP_TASKS = [mlp_up, mlp_down]


@triton.jit
def gemv_kernel(w, x, y, k, BN: tl.constexpr, BK: tl.constexpr, SILU: tl.constexpr):
    """The per-op peer: one program per BN rows."""
    gemv_rows(w, x, y, k, tl.program_id(0) * BN, BN, BK, SILU, 0, False)
