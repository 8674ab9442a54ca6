"""Tasks, tile bodies and peer kernels for `warploop bench runtime`: the same bodies run as runtime
tasks and as ordinary Triton kernels (launched one by one, or captured in a CUDA graph), so the
comparisons measure scheduling, not different code. The MLP stack's tile bodies are registered as
tasks, one pair per schedule, in runtime_mlp_tasks.py.
"""
from __future__ import annotations

import triton
import triton.language as tl

import warploop
from warploop.bench.runtime_flags import signal_flag, signal_group, wait_flags, wait_groups
from warploop.runtime import device as wl
from warploop.runtime.sync import wait_ge


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
def prefetch_l2(p, nbytes, LINES: tl.constexpr, BACKEND: tl.constexpr):
    """Ask L2 for [p, p + nbytes), nbytes <= LINES * 128: fire and forget, no registers held.

    A worker names a tile it will read later (its next instructions'), so HBM streams weights
    while the worker waits at a GEMV boundary. CUDA only (prefetch.global.L2); a no-op elsewhere.
    """
    if BACKEND == "cuda":
        if nbytes > 0:
            lines = tl.minimum(tl.arange(0, LINES) * 128, nbytes - 1)
            tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l",
                                      [p.to(tl.pointer_type(tl.int8), bitcast=True) + lines],
                                      dtype=tl.int32, is_pure=False, pack=1)


# One thread per 16 KB piece asks for it with Hopper's bulk L2 prefetch: 8 instructions for a 128 KB
# tile where line prefetches take 1024. $1: address (16-byte aligned), $2: bytes (a multiple of 16).
PF_BULK = tl.constexpr("""{
.reg .pred %pp;
setp.gt.s32 %pp, $2, 0;
@%pp cp.async.bulk.prefetch.L2.global [$1], $2;
mov.u32 $0, 0;
}""")
PIECE = tl.constexpr(16384)


@triton.jit
def prefetch_bulk(p, nbytes, PIECES: tl.constexpr, BACKEND: tl.constexpr):
    """Ask L2 for [p, p + nbytes), nbytes <= PIECES * 16 KB, 16-byte aligned (sm_90: bulk prefetch)."""
    if BACKEND == "cuda":
        k = tl.arange(0, PIECES)
        size = tl.minimum(tl.maximum(nbytes - k * PIECE, 0), PIECE)
        tl.inline_asm_elementwise(PF_BULK, "=r,l,r", [p.to(tl.pointer_type(tl.int8), bitcast=True) + k * PIECE, size],
                                  dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def prefetch_rest(tile, k, BN: tl.constexpr, K: tl.constexpr, SKIP: tl.constexpr, ROWP: tl.constexpr,
                  BACKEND: tl.constexpr):
    """Ask L2 for columns [SKIP, K) of the BN bf16 rows at `tile` (row stride k): the part of a tile
    its task does not load before waiting. ROWP: a power of two >= the lines per row asked for."""
    if BACKEND == "cuda":
        rest: tl.constexpr = (K - SKIP) * 2 // 128
        line = tl.minimum(tl.arange(0, ROWP), rest - 1)[None, :]
        rows = tl.arange(0, BN)[:, None]
        p = tile.to(tl.pointer_type(tl.int8), bitcast=True) + rows * (2 * k) + SKIP * 2 + line * 128
        tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [p], dtype=tl.int32,
                                  is_pure=False, pack=1)


@triton.jit
def gemv_rows(w, x, y, k, row0, BN: tl.constexpr, BK: tl.constexpr, SILU: tl.constexpr, ctx, WAIT: tl.constexpr,
              BACKEND: tl.constexpr = wl.PORTABLE):
    """y[row0:row0+BN] = act(w[row0:row0+BN, :] @ x) for row-major bf16 w, k columns, k % BK == 0.

    With WAIT, the first chunk of weights is issued before waiting for x (it needs no predecessor).
    Each chunk is reduced across the tile (the round-1 body; gemv_rows_unrolled reduces once).
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
                       BACKEND: tl.constexpr = wl.PORTABLE, flags=0, after=0, TILES: tl.constexpr = 0,
                       stamps=0, STAMP: tl.constexpr = False, pf=0, pf_n=0, PF_END: tl.constexpr = 0,
                       PF_REST: tl.constexpr = 0):
    """gemv_rows for a compile-time width K (k == K): the chunk loop is unrolled and products
    accumulate in a [BN, BK] fp32 block, reduced once per tile. With no reduction (a cross-warp
    barrier) between chunks, every chunk's load can be in flight at once; AHEAD chunks (1 to 8)
    are issued before the wait for x, the rest where the compiler schedules them.

    WAIT: 0 none, 1 the graph's counters (wl.wait), 2 per-tile flags (runtime_flags.py): wait for
    the previous GEMV's TILES flags when `after` is nonzero, then signal this tile's flag; 4 the same
    with 16 group counters per GEMV (runtime_flags.wait_groups, signal_group); 3 a plain
    counter (runtime_mlp_probe.py): wait for *flags >= after (after > 0), then add 1 to flags[TILES].
    STAMP: write (entry, wait done, end) on the global timer and the SM id to stamps[0:4] (CUDA).
    PF_END: once the tile is summed, ask L2 for [pf, pf + pf_n) (the worker's next tile), so HBM
    streams it through the signal, the worker loop and the next wait: 1 line prefetches, 2 bulk.
    (Measured slower: the signal's release fence waits for the prefetches.)
    PF_REST: a power of two >= the lines per row beyond the AHEAD chunks, or 0: first ask L2 for the
    chunks not loaded before the wait, so HBM streams the whole tile while the task waits.
    """
    if PF_REST != 0:
        prefetch_rest(w + row0 * k, k, BN, K, AHEAD * BK, PF_REST, BACKEND)
    if STAMP:
        t_in = tl.extra.cuda.globaltimer()
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
    if WAIT == 1:
        wl.wait(ctx, BACKEND)
    if WAIT == 2:
        if after != 0:
            wait_flags(wl.arena_of(ctx), flags, row0 // BN, TILES, BACKEND)
    if WAIT == 3:
        if after > 0:
            wait_ge(ctx, flags, after, BACKEND)
    if WAIT == 4:
        if after != 0:
            wait_groups(wl.arena_of(ctx), flags, row0 // BN, TILES, BACKEND)
    if STAMP:
        t_wait = tl.extra.cuda.globaltimer()
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
    if PF_END == 1:
        prefetch_l2(pf, pf_n, BN * K * 2 // 128, BACKEND)
    if PF_END == 2:
        prefetch_bulk(pf, pf_n, (BN * K * 2 + PIECE - 1) // PIECE, BACKEND)
    if SILU:
        out = out * tl.sigmoid(out)
    tl.store(y + rows, out.to(tl.bfloat16))
    if WAIT == 2:
        signal_flag(flags, row0 // BN, BACKEND)
    if WAIT == 3:
        tl.debug_barrier()
        tl.atomic_add(flags + TILES, 1, sem="release")
    if WAIT == 4:
        signal_group(flags, row0 // BN, TILES)
    if STAMP:
        t_end = tl.extra.cuda.globaltimer()
        smid = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=True, pack=1)
        k4 = tl.arange(0, 4)
        tl.store(stamps + k4, tl.where(k4 == 0, t_in, tl.where(k4 == 1, t_wait, tl.where(k4 == 2, t_end, smid))))


@triton.jit
def gemv_rows_pipelined(w, x, y, k, row0, BN: tl.constexpr, BK: tl.constexpr, K: tl.constexpr, AHEAD: tl.constexpr,
                        STAGES: tl.constexpr, SILU: tl.constexpr, ctx, BACKEND: tl.constexpr = wl.PORTABLE):
    """gemv_rows_unrolled's tile with the chunks after the wait streamed through shared memory.

    AHEAD chunks are loaded into registers before the wait (as there); after it, the other chunks go
    through a `tl.range(..., num_stages=STAGES)` loop that Triton software-pipelines with cp.async,
    so STAGES - 1 chunks (weights and x) are in flight in shared memory, not registers. The
    registered chunks are summed after the loop: the loop's first loads go out right after the wait.
    """
    rows = row0 + tl.arange(0, BN)
    cols = tl.arange(0, BK)
    tile = w + rows[:, None] * k + cols[None, :]
    tl.static_assert(AHEAD == 1 or AHEAD == 2 or AHEAD == 4)
    a = tl.load(tile, eviction_policy="evict_first")
    if AHEAD >= 2:
        b = tl.load(tile + BK, eviction_policy="evict_first")
    if AHEAD >= 4:
        c = tl.load(tile + 2 * BK, eviction_policy="evict_first")
        d = tl.load(tile + 3 * BK, eviction_policy="evict_first")
    wl.wait(ctx, BACKEND)
    xrow = x + cols[None, :] + 0 * rows[:, None]
    acc = tl.zeros([BN, BK], tl.float32)
    for k0 in tl.range(AHEAD * BK, K, BK, num_stages=STAGES):
        acc += (tl.load(tile + k0, eviction_policy="evict_first").to(tl.float32)
                * tl.load(xrow + k0).to(tl.float32))
    acc += a.to(tl.float32) * tl.load(xrow).to(tl.float32)
    if AHEAD >= 2:
        acc += b.to(tl.float32) * tl.load(xrow + BK).to(tl.float32)
    if AHEAD >= 4:
        acc += c.to(tl.float32) * tl.load(xrow + 2 * BK).to(tl.float32)
        acc += d.to(tl.float32) * tl.load(xrow + 3 * BK).to(tl.float32)
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
    gemv_rows_unrolled(w, x, y, k, tl.program_id(0) * BN, BN, BK, K, 1, SILU, 0, 0)
