"""The MLP stack's tile schedules for `warploop bench runtime`: the tile bodies of runtime_kernels.py
registered as runtime tasks with their tile sizes, one pair (up GEMV, down GEMV) per schedule.

`MLP_VARIANTS` names every schedule measured so far; `MLP_BENCH` the ones the bench times now (the
others measured slower on an H200: BENCHMARKS.md, Runtime). A task is one registration, so each
schedule has its own pair of functions, differing only in the constants they are registered with.
"""
from __future__ import annotations

import triton
import triton.language as tl

import warploop
from warploop.bench.runtime_kernels import gemv_rows, gemv_rows_pipelined, gemv_rows_unrolled, prefetch_l2

UP = {"BN": 16, "BK": 512}       # 2048 -> 8192: 512 tiles of 16 rows
DOWN = {"BN": 4, "BK": 2048}     # 8192 -> 2048: 512 tiles of 4 rows
TILE_BYTES = 16 * 2048 * 2       # both tiles are 64 KB of contiguous rows
PF_LINES = tl.constexpr(TILE_BYTES // 128)
# pf, pf_n: a tile to prefetch into L2 before waiting (pf_n = 0: none); the bench picks it.
# ":16": aligned rows, so weight and activation loads are 16 bytes wide (as in the per-op kernel).
MLP_SIG = {"w": "*bf16:16", "x": "*bf16:16", "y": "*bf16", "k": "i32:16", "row0": "i32", "pf": "*bf16", "pf_n": "i32"}


@warploop.task(signature=MLP_SIG, constexprs=UP, waits=True, cost=1.0)
@triton.jit
def mlp_up(ctx, w, x, y, k, row0, pf, pf_n, BN: tl.constexpr, BK: tl.constexpr, BACKEND: tl.constexpr):
    prefetch_l2(pf, pf_n, PF_LINES, BACKEND)
    gemv_rows(w, x, y, k, row0, BN, BK, True, ctx, True, BACKEND)


@warploop.task(signature=MLP_SIG, constexprs=DOWN, waits=True, cost=1.0)
@triton.jit
def mlp_down(ctx, w, x, y, k, row0, pf, pf_n, BN: tl.constexpr, BK: tl.constexpr, BACKEND: tl.constexpr):
    prefetch_l2(pf, pf_n, PF_LINES, BACKEND)
    gemv_rows(w, x, y, k, row0, BN, BK, False, ctx, True, BACKEND)


# The same tiles, unrolled, one reduction per tile; AHEAD chunks of the tile issued before the wait.
UP_A2 = {"BN": 16, "BK": 512, "K": 2048, "AHEAD": 2}
DOWN_A2 = {"BN": 4, "BK": 2048, "K": 8192, "AHEAD": 2}
UP_A4 = {**UP_A2, "AHEAD": 4}        # the whole 64 KB tile in registers while waiting
DOWN_A4 = {**DOWN_A2, "AHEAD": 4}


@triton.jit
def mlp_unrolled(ctx, w, x, y, k, row0, pf, pf_n, BN: tl.constexpr, BK: tl.constexpr, K: tl.constexpr,
                 AHEAD: tl.constexpr, SILU: tl.constexpr, BACKEND: tl.constexpr):
    prefetch_l2(pf, pf_n, PF_LINES, BACKEND)
    gemv_rows_unrolled(w, x, y, k, row0, BN, BK, K, AHEAD, SILU, ctx, 1, BACKEND)


@warploop.task(signature=MLP_SIG, constexprs=UP_A2, waits=True, cost=1.0)
@triton.jit
def mlp_up_a2(ctx, w, x, y, k, row0, pf, pf_n, BN: tl.constexpr, BK: tl.constexpr, K: tl.constexpr,
              AHEAD: tl.constexpr, BACKEND: tl.constexpr):
    mlp_unrolled(ctx, w, x, y, k, row0, pf, pf_n, BN, BK, K, AHEAD, True, BACKEND)


@warploop.task(signature=MLP_SIG, constexprs=DOWN_A2, waits=True, cost=1.0)
@triton.jit
def mlp_down_a2(ctx, w, x, y, k, row0, pf, pf_n, BN: tl.constexpr, BK: tl.constexpr, K: tl.constexpr,
                AHEAD: tl.constexpr, BACKEND: tl.constexpr):
    mlp_unrolled(ctx, w, x, y, k, row0, pf, pf_n, BN, BK, K, AHEAD, False, BACKEND)


@warploop.task(signature=MLP_SIG, constexprs=UP_A4, waits=True, cost=1.0)
@triton.jit
def mlp_up_a4(ctx, w, x, y, k, row0, pf, pf_n, BN: tl.constexpr, BK: tl.constexpr, K: tl.constexpr,
              AHEAD: tl.constexpr, BACKEND: tl.constexpr):
    mlp_unrolled(ctx, w, x, y, k, row0, pf, pf_n, BN, BK, K, AHEAD, True, BACKEND)


@warploop.task(signature=MLP_SIG, constexprs=DOWN_A4, waits=True, cost=1.0)
@triton.jit
def mlp_down_a4(ctx, w, x, y, k, row0, pf, pf_n, BN: tl.constexpr, BK: tl.constexpr, K: tl.constexpr,
                AHEAD: tl.constexpr, BACKEND: tl.constexpr):
    mlp_unrolled(ctx, w, x, y, k, row0, pf, pf_n, BN, BK, K, AHEAD, False, BACKEND)


# One tile per worker per GEMV (256 tiles: 32 rows up, 8 rows down, 128 KB), eight 16 KB chunks: half
# the tasks, signals and reductions, and the unrolled chunks stream through one task without a gap.
# (AHEAD=4 here: 806 B of spills in ptxas for sm_90a, so not offered.)
UP_W = {"BN": 32, "BK": 256, "K": 2048, "AHEAD": 2}
DOWN_W = {"BN": 8, "BK": 1024, "K": 8192, "AHEAD": 2}


@warploop.task(signature=MLP_SIG, constexprs=UP_W, waits=True, cost=1.0)
@triton.jit
def mlp_up_w(ctx, w, x, y, k, row0, pf, pf_n, BN: tl.constexpr, BK: tl.constexpr, K: tl.constexpr,
             AHEAD: tl.constexpr, BACKEND: tl.constexpr):
    mlp_unrolled(ctx, w, x, y, k, row0, pf, pf_n, BN, BK, K, AHEAD, True, BACKEND)


@warploop.task(signature=MLP_SIG, constexprs=DOWN_W, waits=True, cost=1.0)
@triton.jit
def mlp_down_w(ctx, w, x, y, k, row0, pf, pf_n, BN: tl.constexpr, BK: tl.constexpr, K: tl.constexpr,
               AHEAD: tl.constexpr, BACKEND: tl.constexpr):
    mlp_unrolled(ctx, w, x, y, k, row0, pf, pf_n, BN, BK, K, AHEAD, False, BACKEND)


# The worker tiles with the next tile requested into L2 at the end of each (PF_END): pf, pf_n name the
# worker's next instruction's tile (prefetch distance 1), so HBM keeps streaming across the boundary.
UP_WE = {**UP_W, "PF_END": 1}
DOWN_WE = {**DOWN_W, "PF_END": 1}


@warploop.task(signature=MLP_SIG, constexprs=UP_WE, waits=True, cost=1.0)
@triton.jit
def mlp_up_we(ctx, w, x, y, k, row0, pf, pf_n, BN: tl.constexpr, BK: tl.constexpr, K: tl.constexpr,
              AHEAD: tl.constexpr, PF_END: tl.constexpr, BACKEND: tl.constexpr):
    gemv_rows_unrolled(w, x, y, k, row0, BN, BK, K, AHEAD, True, ctx, 1, BACKEND, pf=pf, pf_n=pf_n, PF_END=PF_END)


@warploop.task(signature=MLP_SIG, constexprs=DOWN_WE, waits=True, cost=1.0)
@triton.jit
def mlp_down_we(ctx, w, x, y, k, row0, pf, pf_n, BN: tl.constexpr, BK: tl.constexpr, K: tl.constexpr,
                AHEAD: tl.constexpr, PF_END: tl.constexpr, BACKEND: tl.constexpr):
    gemv_rows_unrolled(w, x, y, k, row0, BN, BK, K, AHEAD, False, ctx, 1, BACKEND, pf=pf, pf_n=pf_n, PF_END=PF_END)


# The worker tiles, asking L2 for the chunks beyond AHEAD before the wait (PF_REST: lines per row
# beyond them, rounded up to a power of two: 24 -> 32 up, 96 -> 128 down).
UP_WR = {**UP_W, "PF_REST": 32}
DOWN_WR = {**DOWN_W, "PF_REST": 128}


@warploop.task(signature=MLP_SIG, constexprs=UP_WR, waits=True, cost=1.0)
@triton.jit
def mlp_up_wr(ctx, w, x, y, k, row0, pf, pf_n, BN: tl.constexpr, BK: tl.constexpr, K: tl.constexpr,
              AHEAD: tl.constexpr, PF_REST: tl.constexpr, BACKEND: tl.constexpr):
    gemv_rows_unrolled(w, x, y, k, row0, BN, BK, K, AHEAD, True, ctx, 1, BACKEND, PF_REST=PF_REST)


@warploop.task(signature=MLP_SIG, constexprs=DOWN_WR, waits=True, cost=1.0)
@triton.jit
def mlp_down_wr(ctx, w, x, y, k, row0, pf, pf_n, BN: tl.constexpr, BK: tl.constexpr, K: tl.constexpr,
                AHEAD: tl.constexpr, PF_REST: tl.constexpr, BACKEND: tl.constexpr):
    gemv_rows_unrolled(w, x, y, k, row0, BN, BK, K, AHEAD, False, ctx, 1, BACKEND, PF_REST=PF_REST)


# The worker tiles in 8 KB chunks (BK 128 up, 512 down): a quarter of the accumulator registers of
# 16 KB chunks, so more of the tile is in flight before the wait (AHEAD 4: 32 KB as before; 6: 48 KB;
# 8: 64 KB, half the tile).
UP_C4 = {"BN": 32, "BK": 128, "K": 2048, "AHEAD": 4}
DOWN_C4 = {"BN": 8, "BK": 512, "K": 8192, "AHEAD": 4}
UP_C6, DOWN_C6 = {**UP_C4, "AHEAD": 6}, {**DOWN_C4, "AHEAD": 6}
UP_C8, DOWN_C8 = {**UP_C4, "AHEAD": 8}, {**DOWN_C4, "AHEAD": 8}


@warploop.task(signature=MLP_SIG, constexprs=UP_C4, waits=True, cost=1.0)
@triton.jit
def mlp_up_c4(ctx, w, x, y, k, row0, pf, pf_n, BN: tl.constexpr, BK: tl.constexpr, K: tl.constexpr,
              AHEAD: tl.constexpr, BACKEND: tl.constexpr):
    mlp_unrolled(ctx, w, x, y, k, row0, pf, pf_n, BN, BK, K, AHEAD, True, BACKEND)


@warploop.task(signature=MLP_SIG, constexprs=DOWN_C4, waits=True, cost=1.0)
@triton.jit
def mlp_down_c4(ctx, w, x, y, k, row0, pf, pf_n, BN: tl.constexpr, BK: tl.constexpr, K: tl.constexpr,
                AHEAD: tl.constexpr, BACKEND: tl.constexpr):
    mlp_unrolled(ctx, w, x, y, k, row0, pf, pf_n, BN, BK, K, AHEAD, False, BACKEND)


@warploop.task(signature=MLP_SIG, constexprs=UP_C6, waits=True, cost=1.0)
@triton.jit
def mlp_up_c6(ctx, w, x, y, k, row0, pf, pf_n, BN: tl.constexpr, BK: tl.constexpr, K: tl.constexpr,
              AHEAD: tl.constexpr, BACKEND: tl.constexpr):
    mlp_unrolled(ctx, w, x, y, k, row0, pf, pf_n, BN, BK, K, AHEAD, True, BACKEND)


@warploop.task(signature=MLP_SIG, constexprs=DOWN_C6, waits=True, cost=1.0)
@triton.jit
def mlp_down_c6(ctx, w, x, y, k, row0, pf, pf_n, BN: tl.constexpr, BK: tl.constexpr, K: tl.constexpr,
                AHEAD: tl.constexpr, BACKEND: tl.constexpr):
    mlp_unrolled(ctx, w, x, y, k, row0, pf, pf_n, BN, BK, K, AHEAD, False, BACKEND)


@warploop.task(signature=MLP_SIG, constexprs=UP_C8, waits=True, cost=1.0)
@triton.jit
def mlp_up_c8(ctx, w, x, y, k, row0, pf, pf_n, BN: tl.constexpr, BK: tl.constexpr, K: tl.constexpr,
              AHEAD: tl.constexpr, BACKEND: tl.constexpr):
    mlp_unrolled(ctx, w, x, y, k, row0, pf, pf_n, BN, BK, K, AHEAD, True, BACKEND)


@warploop.task(signature=MLP_SIG, constexprs=DOWN_C8, waits=True, cost=1.0)
@triton.jit
def mlp_down_c8(ctx, w, x, y, k, row0, pf, pf_n, BN: tl.constexpr, BK: tl.constexpr, K: tl.constexpr,
                AHEAD: tl.constexpr, BACKEND: tl.constexpr):
    mlp_unrolled(ctx, w, x, y, k, row0, pf, pf_n, BN, BK, K, AHEAD, False, BACKEND)


# The worker tiles with the chunks after the wait pipelined through shared memory (cp.async).
UP_P = {"BN": 32, "BK": 128, "K": 2048, "AHEAD": 4, "STAGES": 4}
DOWN_P = {"BN": 8, "BK": 512, "K": 8192, "AHEAD": 4, "STAGES": 4}


@warploop.task(signature=MLP_SIG, constexprs=UP_P, waits=True, cost=1.0)
@triton.jit
def mlp_up_p(ctx, w, x, y, k, row0, pf, pf_n, BN: tl.constexpr, BK: tl.constexpr, K: tl.constexpr,
             AHEAD: tl.constexpr, STAGES: tl.constexpr, BACKEND: tl.constexpr):
    gemv_rows_pipelined(w, x, y, k, row0, BN, BK, K, AHEAD, STAGES, True, ctx, BACKEND)


@warploop.task(signature=MLP_SIG, constexprs=DOWN_P, waits=True, cost=1.0)
@triton.jit
def mlp_down_p(ctx, w, x, y, k, row0, pf, pf_n, BN: tl.constexpr, BK: tl.constexpr, K: tl.constexpr,
               AHEAD: tl.constexpr, STAGES: tl.constexpr, BACKEND: tl.constexpr):
    gemv_rows_pipelined(w, x, y, k, row0, BN, BK, K, AHEAD, STAGES, False, ctx, BACKEND)


# The worker tiles again, synchronised by per-tile flags (runtime_flags.py) instead of graph edges:
# the graph is recorded without dependencies and each tile waits for, then signals, its flags.
# flags: this GEMV's row of a [GEMVs, TILES] int32 array; after: 0 for a run's first GEMV, else 1.
# pf, pf_n as in MLP_SIG, up to a whole 128 KB worker tile: fetched into L2 (no registers held)
# while the worker waits, so after the wait the tile's other chunks come from L2, not HBM.
FLAG_SIG = {**MLP_SIG, "flags": "*i32", "after": "i32"}
UP_F = {**UP_W, "TILES": 256}        # the previous GEMV's tiles: 2048 / 8 (down) and 8192 / 32 (up)
DOWN_F = {**DOWN_W, "TILES": 256}
PF_LINES_W = tl.constexpr(32 * 2048 * 2 // 128)


@warploop.task(signature=FLAG_SIG, constexprs=UP_F, cost=1.0)
@triton.jit
def mlp_up_f(ctx, w, x, y, k, row0, pf, pf_n, flags, after, BN: tl.constexpr, BK: tl.constexpr, K: tl.constexpr,
             AHEAD: tl.constexpr, TILES: tl.constexpr, BACKEND: tl.constexpr):
    prefetch_l2(pf, pf_n, PF_LINES_W, BACKEND)
    gemv_rows_unrolled(w, x, y, k, row0, BN, BK, K, AHEAD, True, ctx, 2, BACKEND, flags, after, TILES)


@warploop.task(signature=FLAG_SIG, constexprs=DOWN_F, cost=1.0)
@triton.jit
def mlp_down_f(ctx, w, x, y, k, row0, pf, pf_n, flags, after, BN: tl.constexpr, BK: tl.constexpr,
               K: tl.constexpr, AHEAD: tl.constexpr, TILES: tl.constexpr, BACKEND: tl.constexpr):
    prefetch_l2(pf, pf_n, PF_LINES_W, BACKEND)
    gemv_rows_unrolled(w, x, y, k, row0, BN, BK, K, AHEAD, False, ctx, 2, BACKEND, flags, after, TILES)


# The worker tiles synchronised by 16 group counters per GEMV (16 tiles count into each; a waiter's
# 16 lanes poll the 16 lines): fewer signals per address than one counter, fewer polls than flags.
@warploop.task(signature=FLAG_SIG, constexprs=UP_F, cost=1.0)
@triton.jit
def mlp_up_g(ctx, w, x, y, k, row0, pf, pf_n, flags, after, BN: tl.constexpr, BK: tl.constexpr, K: tl.constexpr,
             AHEAD: tl.constexpr, TILES: tl.constexpr, BACKEND: tl.constexpr):
    gemv_rows_unrolled(w, x, y, k, row0, BN, BK, K, AHEAD, True, ctx, 4, BACKEND, flags, after, TILES)


@warploop.task(signature=FLAG_SIG, constexprs=DOWN_F, cost=1.0)
@triton.jit
def mlp_down_g(ctx, w, x, y, k, row0, pf, pf_n, flags, after, BN: tl.constexpr, BK: tl.constexpr,
               K: tl.constexpr, AHEAD: tl.constexpr, TILES: tl.constexpr, BACKEND: tl.constexpr):
    gemv_rows_unrolled(w, x, y, k, row0, BN, BK, K, AHEAD, False, ctx, 4, BACKEND, flags, after, TILES)


# name -> (up task, down task, up tiles, down tiles, prefetch distance): each is its own runtime.
# Distance d: a node prefetches the tile of the instruction d places later on its worker (None: no
# prefetch; 0: its own tile, fetched into L2 while it waits). With 512 tiles per GEMV each worker runs
# two, so d = 2 is the same slot one GEMV ahead; with worker tiles, d = 1 is.
# "single" is the round-1 figure's schedule, re-measured for comparison. Round 1's L2-prefetch and
# two-chunks-in-flight variants (no gain over it) are not timed; the prefetch arguments stay (pf_n = 0).
MLP_VARIANTS = {"single": (mlp_up, mlp_down, UP, DOWN, None),
                "unrolled_ahead2": (mlp_up_a2, mlp_down_a2, UP_A2, DOWN_A2, None),
                "unrolled_ahead4": (mlp_up_a4, mlp_down_a4, UP_A4, DOWN_A4, None),
                "worker_tile_ahead2": (mlp_up_w, mlp_down_w, UP_W, DOWN_W, None),
                "worker_tile_pf_end": (mlp_up_we, mlp_down_we, UP_WE, DOWN_WE, 1),
                "worker_tile_pf_rest": (mlp_up_wr, mlp_down_wr, UP_WR, DOWN_WR, None),
                "worker_tile_8k_ahead4": (mlp_up_c4, mlp_down_c4, UP_C4, DOWN_C4, None),
                "worker_tile_8k_ahead6": (mlp_up_c6, mlp_down_c6, UP_C6, DOWN_C6, None),
                "worker_tile_8k_ahead8": (mlp_up_c8, mlp_down_c8, UP_C8, DOWN_C8, None),
                "worker_tile_pipelined": (mlp_up_p, mlp_down_p, UP_P, DOWN_P, None),
                "worker_tile_groups": (mlp_up_g, mlp_down_g, UP_F, DOWN_F, None),
                "worker_tile_flags": (mlp_up_f, mlp_down_f, UP_F, DOWN_F, None),
                "worker_tile_flags_pf0": (mlp_up_f, mlp_down_f, UP_F, DOWN_F, 0),
                "worker_tile_flags_pf1": (mlp_up_f, mlp_down_f, UP_F, DOWN_F, 1)}
# The schedules `warploop bench runtime` times (each in its own runtime; the figure is the fastest
# correct one). The others stay for the record: on an H200 (BENCHMARKS.md, Runtime) every one of them
# measured slower than worker_tile_ahead2 once the front stopped polling the host with every thread.
MLP_BENCH = ("worker_tile_ahead2", "worker_tile_8k_ahead4", "worker_tile_8k_ahead6")
# Variants synchronised by flags -> the counter variant of the same tiles (for the diagnostic).
FLAG_VARIANTS = {name: "worker_tile_ahead2" for name in MLP_VARIANTS
                 if name.startswith("worker_tile_flags") or name == "worker_tile_groups"}
# int32 words of sync state per GEMV for those variants: a flag per tile, or 16 counters on their own lines.
FLAG_WORDS = {name: 512 if name == "worker_tile_groups" else 256 for name in FLAG_VARIANTS}
