"""The GEMV chunk stream (the GPU plan's default: Plan.hidden / inter set, tile_kb 0): one node per
worker owns a span of BN-row blocks over a compile-time width K and streams its weights as one
run-time loop of [BN, BK] chunks, `Plan.depth` loads in flight across row blocks (gate then up
rows for gate_up). More than one live row takes gemv.batch_blocks.
"""
from __future__ import annotations

import triton
import triton.language as tl

from warploop.llm.mk.gemv import EPI_SILU, batch_blocks, epilogue, row_rstd, x_chunk
from warploop.llm.mk.layout import step_rows
from warploop.llm.mk.numerics import mma
from warploop.runtime import device as wl


@triton.jit
def chunk_at(w, j, row0, end, f, K: tl.constexpr, NCH: tl.constexpr, SUB: tl.constexpr, BN: tl.constexpr,
             BK: tl.constexpr, J):
    """Chunk j of a node's weight stream: (pointers, mask) of a [BN, BK] block. The stream runs
    block by block (SUB = 2: gate rows, then the up rows f further down), NCH chunks per row block;
    j >= J is masked off (nothing read)."""
    sb = j // NCH
    c = j - sb * NCH
    blk = sb // SUB
    half = sb - blk * SUB
    rows = row0 + blk * BN + tl.arange(0, BN)
    cols = c * BK + tl.arange(0, BK)
    ptr = w + (rows + half * f).to(tl.int64)[:, None] * K + cols[None, :]
    return ptr, ((rows < end) & (j < J))[:, None] & (cols < K)[None, :]


@triton.jit
def stream_step(w, bias, x, norm_w, out, n_out, f, row0, end, J, j, chunk, acc, gate, brow, bmask, bo, nb, rstd,
                has_bias, NORM: tl.constexpr, EPI: tl.constexpr, SINGLE: tl.constexpr, K: tl.constexpr,
                R: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DEPTH: tl.constexpr, BACKEND: tl.constexpr):
    """Chunk j of the stream (`chunk`, loaded DEPTH steps before): issue chunk j + DEPTH, multiply,
    and after a row block's last chunk run its epilogue. Returns (acc, gate, chunk j + DEPTH)."""
    NCH: tl.constexpr = (K + BK - 1) // BK
    SUB: tl.constexpr = 2 if EPI == EPI_SILU else 1
    ptr, mask = chunk_at(w, j + DEPTH, row0, end, f, K, NCH, SUB, BN, BK, J)
    nxt = tl.load(ptr, mask=mask, other=0.0, eviction_policy="evict_first")
    sb = j // NCH
    c = j - sb * NCH
    xv = x_chunk(x, K, brow, bmask, c * BK + tl.arange(0, BK), K, norm_w, rstd, NORM, BACKEND)
    if SINGLE:
        acc += chunk.to(tl.float32) * xv.to(tl.float32)
    else:
        acc += mma(xv, tl.trans(chunk), BACKEND)
    if (c == NCH - 1) & (j < J):
        if SINGLE:
            total = tl.sum(acc, axis=1)[None, :]
        else:
            total = acc
        acc = tl.zeros(acc.shape, tl.float32)
        blk = sb // SUB
        rows = row0 + blk * BN + tl.arange(0, BN)
        if SUB == 2 and sb - blk * SUB == 0:
            gate = total
        else:
            epilogue(gate if SUB == 2 else total, total, bias, out, rows, rows < end, bo, bo < nb, n_out, f, has_bias,
                     w.dtype.element_ty, EPI, BACKEND)
    return acc, gate, nxt


@triton.jit
def gemv_stream(w, bias, x, norm_w, out, n_out, f, row0, end, b0, nb, rstd, a0, a1, a2, a3, a4, a5, a6, a7,
                has_bias, NORM: tl.constexpr, EPI: tl.constexpr, SINGLE: tl.constexpr, K: tl.constexpr,
                R: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DEPTH: tl.constexpr, BACKEND: tl.constexpr):
    """The node's rows [row0, end) for batch rows b0.. (SINGLE: b0 only) as one stream of [BN, BK]
    weight chunks, DEPTH (4 or 8) loads in flight: a0.. are the stream's first DEPTH chunks, loaded
    by the caller.

    The loop is unrolled DEPTH times and chunk slot k is consumed and reloaded in place (a_k: chunk
    j + k, then chunk j + k + DEPTH), so a load's register is carried to the next iteration as is.
    (A rotation a0, a1, ... = a1, ..., nxt in a rolled loop copies the newest load's register at
    every back edge, which waits for that load: one chunk in flight whatever DEPTH said, measured
    as 8 in flight no faster than 4.) A row block's products accumulate per chunk (SINGLE:
    elementwise into a [BN, BK] float32 block, reduced once at the block's end; else tl.dot into
    [R, BN]); its epilogue runs after its last chunk (EPI_SILU: after the up rows, with the gate
    rows' sums kept). A run-time loop, not an unrolled one over K: the kernel stays small."""
    NCH: tl.constexpr = (K + BK - 1) // BK
    SUB: tl.constexpr = 2 if EPI == EPI_SILU else 1
    J = ((end - row0 + BN - 1) // BN) * SUB * NCH
    if SINGLE:
        brow = b0 + 0 * tl.arange(0, BN)       # row stride 0: x in the tile's [BN, BK] layout
        bo = b0 + tl.arange(0, 1)
        acc = tl.zeros([BN, BK], tl.float32)
        gate = tl.zeros([1, BN], tl.float32)
    else:
        brow = b0 + tl.arange(0, R)
        bo = brow
        acc = tl.zeros([R, BN], tl.float32)
        gate = tl.zeros([R, BN], tl.float32)
    bmask = brow < nb
    for j in range(0, J, DEPTH):
        acc, gate, a0 = stream_step(w, bias, x, norm_w, out, n_out, f, row0, end, J, j, a0, acc, gate, brow, bmask,
                                    bo, nb, rstd, has_bias, NORM, EPI, SINGLE, K, R, BN, BK, DEPTH, BACKEND)
        acc, gate, a1 = stream_step(w, bias, x, norm_w, out, n_out, f, row0, end, J, j + 1, a1, acc, gate, brow,
                                    bmask, bo, nb, rstd, has_bias, NORM, EPI, SINGLE, K, R, BN, BK, DEPTH, BACKEND)
        acc, gate, a2 = stream_step(w, bias, x, norm_w, out, n_out, f, row0, end, J, j + 2, a2, acc, gate, brow,
                                    bmask, bo, nb, rstd, has_bias, NORM, EPI, SINGLE, K, R, BN, BK, DEPTH, BACKEND)
        acc, gate, a3 = stream_step(w, bias, x, norm_w, out, n_out, f, row0, end, J, j + 3, a3, acc, gate, brow,
                                    bmask, bo, nb, rstd, has_bias, NORM, EPI, SINGLE, K, R, BN, BK, DEPTH, BACKEND)
        if DEPTH == 8:
            acc, gate, a4 = stream_step(w, bias, x, norm_w, out, n_out, f, row0, end, J, j + 4, a4, acc, gate, brow,
                                        bmask, bo, nb, rstd, has_bias, NORM, EPI, SINGLE, K, R, BN, BK, DEPTH,
                                        BACKEND)
            acc, gate, a5 = stream_step(w, bias, x, norm_w, out, n_out, f, row0, end, J, j + 5, a5, acc, gate, brow,
                                        bmask, bo, nb, rstd, has_bias, NORM, EPI, SINGLE, K, R, BN, BK, DEPTH,
                                        BACKEND)
            acc, gate, a6 = stream_step(w, bias, x, norm_w, out, n_out, f, row0, end, J, j + 6, a6, acc, gate, brow,
                                        bmask, bo, nb, rstd, has_bias, NORM, EPI, SINGLE, K, R, BN, BK, DEPTH,
                                        BACKEND)
            acc, gate, a7 = stream_step(w, bias, x, norm_w, out, n_out, f, row0, end, J, j + 7, a7, acc, gate, brow,
                                        bmask, bo, nb, rstd, has_bias, NORM, EPI, SINGLE, K, R, BN, BK, DEPTH,
                                        BACKEND)


@triton.jit
def lead_chunk(w, i, row0, end, f, EPI: tl.constexpr, K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """Chunk i of a node's stream (gemv_stream), issued now."""
    NCH: tl.constexpr = (K + BK - 1) // BK
    SUB: tl.constexpr = 2 if EPI == EPI_SILU else 1
    J = ((end - row0 + BN - 1) // BN) * SUB * NCH
    p, m = chunk_at(w, i, row0, end, f, K, NCH, SUB, BN, BK, J)
    return tl.load(p, mask=m, other=0.0, eviction_policy="evict_first")


@triton.jit
def gemv_node_k(ctx, inp, w, bias, x, norm_w, out, n_out, f, row0, count, eps, has_bias, NORM: tl.constexpr,
                EPI: tl.constexpr, K: tl.constexpr, R: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                DEPTH: tl.constexpr, BACKEND: tl.constexpr):
    """gemv_node for a compile-time width K (the model's hidden, q or intermediate size). One live
    row: the node's weights as one stream of chunks (gemv_stream), the first DEPTH issued before
    `wl.wait`. More rows: tl.dot blocks over a constant-bound chunk loop, which Triton's pipeliner
    streams through shared memory itself."""
    end = tl.minimum(row0 + count, n_out)
    a0 = lead_chunk(w, 0, row0, end, f, EPI, K, BN, BK)
    a1 = lead_chunk(w, 1, row0, end, f, EPI, K, BN, BK)
    a2 = lead_chunk(w, 2, row0, end, f, EPI, K, BN, BK)
    a3 = lead_chunk(w, 3, row0, end, f, EPI, K, BN, BK)
    if DEPTH == 8:
        a4 = lead_chunk(w, 4, row0, end, f, EPI, K, BN, BK)
        a5 = lead_chunk(w, 5, row0, end, f, EPI, K, BN, BK)
        a6 = lead_chunk(w, 6, row0, end, f, EPI, K, BN, BK)
        a7 = lead_chunk(w, 7, row0, end, f, EPI, K, BN, BK)
    else:
        a4, a5, a6, a7 = a0, a1, a2, a3      # unused
    nb = step_rows(inp)     # fixed for the run: read before the wait, whose acquire empties L1
    wl.wait(ctx, BACKEND)
    if nb == 1:
        one = tl.arange(0, 1)
        rstd = tl.full([1], 1.0, tl.float32)
        if NORM:
            rstd = row_rstd(x, K, one, one < 1, K, eps, BK)
        gemv_stream(w, bias, x, norm_w, out, n_out, f, row0, end, 0, 1, rstd, a0, a1, a2, a3, a4, a5, a6, a7,
                    has_bias, NORM, EPI, True, K, R, BN, BK, DEPTH, BACKEND)
    else:
        batch_blocks(w, bias, x, norm_w, out, K, n_out, f, row0, end, nb, eps, a0, has_bias, NORM, EPI, R, BN, BK,
                     BACKEND)
