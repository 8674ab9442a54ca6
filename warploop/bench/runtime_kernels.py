"""Tasks, tile bodies and peer kernels for `warploop bench runtime`: the same bodies run as runtime
tasks and as ordinary Triton kernels (launched one by one, or captured in a CUDA graph), so the
comparisons measure scheduling, not different code. The MLP stack's tile bodies are registered as
tasks, one pair per timed schedule, in runtime_mlp_tasks.py.
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
def dot_chunk(wt, x, cols):
    return tl.sum(wt.to(tl.float32) * tl.load(x + cols).to(tl.float32)[None, :], axis=1)


@triton.jit
def gemv_rows(w, x, y, k, row0, BN: tl.constexpr, BK: tl.constexpr, SILU: tl.constexpr, ctx, WAIT: tl.constexpr,
              BACKEND: tl.constexpr = wl.PORTABLE):
    """y[row0:row0+BN] = act(w[row0:row0+BN, :] @ x) for row-major bf16 w, k columns, k % BK == 0.

    With WAIT, the first chunk of weights is issued before waiting for x (it needs no predecessor).
    Each chunk is reduced across the tile (the per-op peer's other body; gemv_rows_unrolled reduces once).
    """
    rows = row0 + tl.arange(0, BN)
    cols = tl.arange(0, BK)
    tile = w + rows[:, None] * k + cols[None, :]
    a = tl.load(tile, eviction_policy="evict_first")
    if WAIT:
        wl.wait(ctx, BACKEND)
    acc = dot_chunk(a, x, cols)
    for k0 in range(BK, k, BK):
        acc += dot_chunk(tl.load(tile + k0, eviction_policy="evict_first"), x + k0, cols)
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(y + rows, acc.to(tl.bfloat16))


@triton.jit
def gemv_rows_unrolled(w, x, y, k, row0, BN: tl.constexpr, BK: tl.constexpr, K: tl.constexpr,
                       AHEAD: tl.constexpr, SILU: tl.constexpr, ctx, WAIT: tl.constexpr,
                       BACKEND: tl.constexpr = wl.PORTABLE):
    """gemv_rows for a compile-time width K (k == K): the chunk loop is unrolled and products
    accumulate in a [BN, BK] fp32 block, reduced once per tile. With no reduction (a cross-warp
    barrier) between chunks, every chunk's load can be in flight at once; AHEAD chunks (1 to 8)
    are issued before the wait for x (WAIT: the graph's counters, wl.wait), the rest where the
    compiler schedules them.
    """
    rows = row0 + tl.arange(0, BN)
    cols = tl.arange(0, BK)
    tile = w + rows[:, None] * k + cols[None, :]
    tl.static_assert(1 <= AHEAD and AHEAD <= 8 and K >= AHEAD * BK)
    a = tl.load(tile, eviction_policy="evict_first")
    if AHEAD >= 2:
        b = tl.load(tile + BK, eviction_policy="evict_first")
    if AHEAD >= 3:
        c = tl.load(tile + 2 * BK, eviction_policy="evict_first")
    if AHEAD >= 4:
        d = tl.load(tile + 3 * BK, eviction_policy="evict_first")
    if AHEAD >= 5:
        e = tl.load(tile + 4 * BK, eviction_policy="evict_first")
    if AHEAD >= 6:
        f = tl.load(tile + 5 * BK, eviction_policy="evict_first")
    if AHEAD >= 7:
        g = tl.load(tile + 6 * BK, eviction_policy="evict_first")
    if AHEAD >= 8:
        h = tl.load(tile + 7 * BK, eviction_policy="evict_first")
    if WAIT:
        wl.wait(ctx, BACKEND)
    # x is loaded through a [BN, BK] pointer block with row stride 0: the tile's own layout, so the
    # product needs no layout conversion (a 1-D load of x is converted through shared memory with
    # a barrier per chunk); the repeated addresses fold to one load.
    xrow = x + cols[None, :] + 0 * rows[:, None]
    acc = a.to(tl.float32) * tl.load(xrow).to(tl.float32)
    for i in tl.static_range(1, K // BK):
        if i < AHEAD:
            if i == 1:
                chunk = b
            elif i == 2:
                chunk = c
            elif i == 3:
                chunk = d
            elif i == 4:
                chunk = e
            elif i == 5:
                chunk = f
            elif i == 6:
                chunk = g
            else:
                chunk = h
        else:
            chunk = tl.load(tile + i * BK, eviction_policy="evict_first")
        acc += chunk.to(tl.float32) * tl.load(xrow + i * BK).to(tl.float32)
    out = tl.sum(acc, axis=1)
    if SILU:
        out = out * tl.sigmoid(out)
    tl.store(y + rows, out.to(tl.bfloat16))


@triton.jit
def gemv_kernel(w, x, y, k, BN: tl.constexpr, BK: tl.constexpr, SILU: tl.constexpr):
    """The per-op peer: one program per BN rows."""
    gemv_rows(w, x, y, k, tl.program_id(0) * BN, BN, BK, SILU, 0, False)


@triton.jit
def gemv_kernel_unrolled(w, x, y, k, BN: tl.constexpr, BK: tl.constexpr, K: tl.constexpr, SILU: tl.constexpr):
    """The per-op peer with the unrolled body (one reduction per tile), so the peer has it too."""
    gemv_rows_unrolled(w, x, y, k, tl.program_id(0) * BN, BN, BK, K, 1, SILU, 0, False)
