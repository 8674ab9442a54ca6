"""The MLP stack's tile schedules that `warploop bench runtime` times: the unrolled tile body of
runtime_kernels.py registered as runtime tasks with its tile sizes, one pair (up GEMV, down GEMV)
per schedule. A task is one registration, so each schedule has its own pair of functions, differing
only in the constants they are registered with.

Every schedule gives each of 256 workers one tile a GEMV (32 rows up, 8 rows down: 128 KB), and
issues AHEAD chunks of it before waiting for x: 16 KB chunks, 2 ahead; 8 KB chunks, 4 or 6 ahead.
"""
from __future__ import annotations

import triton
import triton.language as tl

import warploop
from warploop.bench.runtime_kernels import gemv_rows_unrolled

# ":16": aligned rows, so weight and activation loads are 16 bytes wide (as in the per-op kernel).
MLP_SIG = {"w": "*bf16:16", "x": "*bf16:16", "y": "*bf16", "k": "i32:16", "row0": "i32"}
UP_W = {"BN": 32, "BK": 256, "K": 2048, "AHEAD": 2}
DOWN_W = {"BN": 8, "BK": 1024, "K": 8192, "AHEAD": 2}
UP_C4 = {"BN": 32, "BK": 128, "K": 2048, "AHEAD": 4}
DOWN_C4 = {"BN": 8, "BK": 512, "K": 8192, "AHEAD": 4}
UP_C6, DOWN_C6 = {**UP_C4, "AHEAD": 6}, {**DOWN_C4, "AHEAD": 6}


@triton.jit
def mlp_tile(ctx, w, x, y, k, row0, BN: tl.constexpr, BK: tl.constexpr, K: tl.constexpr, AHEAD: tl.constexpr,
             SILU: tl.constexpr, BACKEND: tl.constexpr):
    gemv_rows_unrolled(w, x, y, k, row0, BN, BK, K, AHEAD, SILU, ctx, True, BACKEND)


@warploop.task(signature=MLP_SIG, constexprs=UP_W, waits=True, cost=1.0)
@triton.jit
def mlp_up_w(ctx, w, x, y, k, row0, BN: tl.constexpr, BK: tl.constexpr, K: tl.constexpr, AHEAD: tl.constexpr,
             BACKEND: tl.constexpr):
    mlp_tile(ctx, w, x, y, k, row0, BN, BK, K, AHEAD, True, BACKEND)


@warploop.task(signature=MLP_SIG, constexprs=DOWN_W, waits=True, cost=1.0)
@triton.jit
def mlp_down_w(ctx, w, x, y, k, row0, BN: tl.constexpr, BK: tl.constexpr, K: tl.constexpr, AHEAD: tl.constexpr,
               BACKEND: tl.constexpr):
    mlp_tile(ctx, w, x, y, k, row0, BN, BK, K, AHEAD, False, BACKEND)


@warploop.task(signature=MLP_SIG, constexprs=UP_C4, waits=True, cost=1.0)
@triton.jit
def mlp_up_c4(ctx, w, x, y, k, row0, BN: tl.constexpr, BK: tl.constexpr, K: tl.constexpr, AHEAD: tl.constexpr,
              BACKEND: tl.constexpr):
    mlp_tile(ctx, w, x, y, k, row0, BN, BK, K, AHEAD, True, BACKEND)


@warploop.task(signature=MLP_SIG, constexprs=DOWN_C4, waits=True, cost=1.0)
@triton.jit
def mlp_down_c4(ctx, w, x, y, k, row0, BN: tl.constexpr, BK: tl.constexpr, K: tl.constexpr, AHEAD: tl.constexpr,
                BACKEND: tl.constexpr):
    mlp_tile(ctx, w, x, y, k, row0, BN, BK, K, AHEAD, False, BACKEND)


@warploop.task(signature=MLP_SIG, constexprs=UP_C6, waits=True, cost=1.0)
@triton.jit
def mlp_up_c6(ctx, w, x, y, k, row0, BN: tl.constexpr, BK: tl.constexpr, K: tl.constexpr, AHEAD: tl.constexpr,
              BACKEND: tl.constexpr):
    mlp_tile(ctx, w, x, y, k, row0, BN, BK, K, AHEAD, True, BACKEND)


@warploop.task(signature=MLP_SIG, constexprs=DOWN_C6, waits=True, cost=1.0)
@triton.jit
def mlp_down_c6(ctx, w, x, y, k, row0, BN: tl.constexpr, BK: tl.constexpr, K: tl.constexpr, AHEAD: tl.constexpr,
                BACKEND: tl.constexpr):
    mlp_tile(ctx, w, x, y, k, row0, BN, BK, K, AHEAD, False, BACKEND)


# name -> (up task, down task, up tiles, down tiles); the bench times each in its own runtime and
# reports the fastest correct one.
MLP_SCHEDULES = {"worker_tile_ahead2": (mlp_up_w, mlp_down_w, UP_W, DOWN_W),
                 "worker_tile_8k_ahead4": (mlp_up_c4, mlp_down_c4, UP_C4, DOWN_C4),
                 "worker_tile_8k_ahead6": (mlp_up_c6, mlp_down_c6, UP_C6, DOWN_C6)}
