"""GEMV tiles (Plan.tile_kb): one node per fixed tile of weight rows over a compile-time width K,
at most layout.TILE_CHUNKS loads in straight-line code, the whole tile in flight at once. More
than one live row takes gemv.batch_blocks.
"""
from __future__ import annotations

import triton
import triton.language as tl

from warploop.llm.mk.gemv import EPI_SILU, batch_blocks, epilogue
from warploop.llm.mk.layout import step_rows
from warploop.llm.mk.numerics import rnd
from warploop.runtime import device as wl


@triton.jit
def tile_chunk(w, i, row0, n_out, f, K: tl.constexpr, TN: tl.constexpr, TK: tl.constexpr, NC: tl.constexpr):
    """Chunk i (a compile-time index) of a tile: columns [c * TK, c * TK + TK) of its TN rows, or of
    the up rows f further down for i >= NC (EPI_SILU); loaded now."""
    c: tl.constexpr = i % NC
    rows = row0 + tl.arange(0, TN)
    cols = c * TK + tl.arange(0, TK)
    ptr = w + (rows + (i // NC) * f).to(tl.int64)[:, None] * K + cols[None, :]
    if (c + 1) * TK > K:
        v = tl.load(ptr, mask=(rows < n_out)[:, None] & (cols < K)[None, :], other=0.0,
                    eviction_policy="evict_first")
    else:
        v = tl.load(ptr, mask=(rows < n_out)[:, None], other=0.0, eviction_policy="evict_first")
    return v


@triton.jit
def tile_rstd(x, eps, K: tl.constexpr, TK: tl.constexpr, NC: tl.constexpr):
    """1 / rms of x's first row over K columns: a float32 scalar (one reduction at the end)."""
    ss = tl.zeros([TK], tl.float32)
    for c in tl.static_range(NC):
        cols = c * TK + tl.arange(0, TK)
        if (c + 1) * TK > K:
            v = tl.load(x + cols, mask=cols < K, other=0.0).to(tl.float32)
        else:
            v = tl.load(x + cols).to(tl.float32)       # unmasked: 16-byte loads
        ss += v * v
    return tl.rsqrt(tl.sum(ss, axis=0) / K + eps)


@triton.jit
def tile_x(x, c0, cols, rows, K: tl.constexpr, TK: tl.constexpr):
    """x[c0 : c0 + TK] in a [TN, TK] block of row stride 0 (the tile's layout: no conversion; a
    thread's repeated addresses fold to one load). Masked only for a tail chunk, so whole chunks
    load 16 bytes at a time."""
    ptr = x + c0 + cols[None, :] + 0 * rows[:, None]
    if c0 + TK > K:
        v = tl.load(ptr, mask=(c0 + cols < K)[None, :] & (rows >= 0)[:, None], other=0.0)
    else:
        v = tl.load(ptr)
    return v


@triton.jit
def pick(i, a0, a1, a2, a3, a4, a5, a6, a7):
    """a_i for a compile-time i."""
    if i == 0:
        v = a0
    elif i == 1:
        v = a1
    elif i == 2:
        v = a2
    elif i == 3:
        v = a3
    elif i == 4:
        v = a4
    elif i == 5:
        v = a5
    elif i == 6:
        v = a6
    else:
        v = a7
    return v


@triton.jit
def gemv_tile(ctx, inp, w, bias, x, norm_w, out, n_out, f, row0, count, eps, has_bias, NORM: tl.constexpr,
              EPI: tl.constexpr, K: tl.constexpr, TN: tl.constexpr, TK: tl.constexpr, AHEAD: tl.constexpr,
              R: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, ONE: tl.constexpr,
              BACKEND: tl.constexpr):
    """One tile: weight rows [row0, row0 + TN) (EPI_SILU: and the up rows f further down) over the
    compile-time width K, in straight-line code (Plan.tile_kb: tens of KB a node). A node of a
    graph for more rows may own `count` rows, several tiles (graph.gemv_spans, BATCH_TILES): those
    take gemv.batch_blocks whatever the live rows. ONE (Plan.one_row): a batch-1 kernel's tile, whose
    batch path is compiled out.

    Batch 1: the tile is at most 8 chunks of [TN, TK] (layout.TILE_CHUNKS; EPI_SILU: gate chunks,
    then up chunks), all issued before anything waits on memory: the first AHEAD before `wl.wait`,
    the rest right after it, before x is read and its norm reduced (a reduction is a barrier, and
    no load is moved above one). So the whole tile is in flight at once. x (and its norm: rstd a
    scalar from one pass over x, then each chunk normalised as layers.rms_norm rounds it) is read
    per chunk through a row-stride-0 block in the tile's own layout, from L2. Products accumulate
    elementwise into [TN, TK] float32 and are reduced once. More rows: the tl.dot blocks of
    gemv.batch_blocks."""
    NC: tl.constexpr = (K + TK - 1) // TK
    SUB: tl.constexpr = 2 if EPI == EPI_SILU else 1
    NCH: tl.constexpr = SUB * NC
    tl.static_assert(NCH <= 8)
    a0 = tile_chunk(w, 0, row0, n_out, f, K, TN, TK, NC)
    a1 = a0
    a2 = a0
    a3 = a0
    a4 = a0
    a5 = a0
    a6 = a0
    a7 = a0
    if AHEAD > 1 and NCH > 1:
        a1 = tile_chunk(w, 1, row0, n_out, f, K, TN, TK, NC)
    if AHEAD > 2 and NCH > 2:
        a2 = tile_chunk(w, 2, row0, n_out, f, K, TN, TK, NC)
    if AHEAD > 3 and NCH > 3:
        a3 = tile_chunk(w, 3, row0, n_out, f, K, TN, TK, NC)
    if AHEAD > 4 and NCH > 4:
        a4 = tile_chunk(w, 4, row0, n_out, f, K, TN, TK, NC)
    if AHEAD > 5 and NCH > 5:
        a5 = tile_chunk(w, 5, row0, n_out, f, K, TN, TK, NC)
    if AHEAD > 6 and NCH > 6:
        a6 = tile_chunk(w, 6, row0, n_out, f, K, TN, TK, NC)
    if AHEAD > 7 and NCH > 7:
        a7 = tile_chunk(w, 7, row0, n_out, f, K, TN, TK, NC)
    nb = step_rows(inp)     # fixed for the run: read before the wait, whose acquire empties L1
    wl.wait(ctx, BACKEND)
    end = tl.minimum(row0 + count, n_out)
    if nb == 1 and count <= TN:
        if AHEAD <= 1 and NCH > 1:
            a1 = tile_chunk(w, 1, row0, n_out, f, K, TN, TK, NC)
        if AHEAD <= 2 and NCH > 2:
            a2 = tile_chunk(w, 2, row0, n_out, f, K, TN, TK, NC)
        if AHEAD <= 3 and NCH > 3:
            a3 = tile_chunk(w, 3, row0, n_out, f, K, TN, TK, NC)
        if AHEAD <= 4 and NCH > 4:
            a4 = tile_chunk(w, 4, row0, n_out, f, K, TN, TK, NC)
        if AHEAD <= 5 and NCH > 5:
            a5 = tile_chunk(w, 5, row0, n_out, f, K, TN, TK, NC)
        if AHEAD <= 6 and NCH > 6:
            a6 = tile_chunk(w, 6, row0, n_out, f, K, TN, TK, NC)
        if AHEAD <= 7 and NCH > 7:
            a7 = tile_chunk(w, 7, row0, n_out, f, K, TN, TK, NC)
        rows = row0 + tl.arange(0, TN)
        cols = tl.arange(0, TK)
        rstd = 1.0
        if NORM:
            rstd = tile_rstd(x, eps, K, TK, NC)
        acc = tl.zeros([TN, TK], tl.float32)
        gate = tl.zeros([TN, TK], tl.float32)
        for i in tl.static_range(NCH):
            c0 = (i % NC) * TK
            xv = tile_x(x, c0, cols, rows, K, TK)
            if NORM:
                nw = tile_x(norm_w, c0, cols, rows, K, TK)
                dt = x.dtype.element_ty
                xv = rnd(nw.to(tl.float32) * rnd(xv.to(tl.float32) * rstd, dt, BACKEND).to(tl.float32), dt, BACKEND)
            acc += pick(i, a0, a1, a2, a3, a4, a5, a6, a7).to(tl.float32) * xv.to(tl.float32)
            if SUB == 2 and i == NC - 1:
                gate = acc
                acc = tl.zeros([TN, TK], tl.float32)
        total = tl.sum(acc, axis=1)[None, :]
        first = total
        if SUB == 2:
            first = tl.sum(gate, axis=1)[None, :]
        bo = tl.arange(0, 1)
        epilogue(first, total, bias, out, rows, rows < end, bo, bo < 1, n_out, f, has_bias, w.dtype.element_ty, EPI,
                 BACKEND)
    elif not ONE:       # a batch-1 kernel runs no graph of more rows
        batch_blocks(w, bias, x, norm_w, out, K, n_out, f, row0, end, nb, eps, a0, has_bias, NORM, EPI, R, BN, BK,
                     BACKEND)
