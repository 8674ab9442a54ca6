"""GEMV tile bodies of the decode graph: out[b, rows] = epilogue(prologue(x[b]) @ w[rows]^T).

One node owns `count` weight rows (a multiple of BN) and every live batch row. Its first weight
chunk is issued before `wl.wait` (it needs no predecessor), so HBM streams while the node waits
for its activations. Products accumulate in float32; values are rounded to the model's dtype
where the per-op backend (layers.py) rounds them, so the two agree to the last bit but for the
order of the float32 sums.

Prologue (NORM): RMSNorm fused into the consumer. The residual stream is never normalised in a
node of its own: each tile recomputes rstd for its batch rows and normalises its x chunks on
the fly (x is B x hidden, read from L2: a few KB against the tile's tens of KB of weights),
which removes a graph boundary per norm.

Epilogues: EPI_OUT stores (+ bias), rounded to the model dtype, in the output's dtype (q/k/v,
lm_head logits); EPI_RES adds
the rounded result into the residual rows it owns (o-proj, down: the residual add fused);
EPI_SILU computes the gate rows and the matching up rows (f further down the fused gate_up
weight) and stores silu(gate) * up.

Batch: one live row takes the GEMV path (a [BN, BK] fp32 block of products, reduced once, x
loaded through a row-stride-0 pointer block in the tile's own layout); more rows go through
tl.dot in blocks of R rows (batch blocks outer, so each block's rstd is computed once).
"""
from __future__ import annotations

import triton
import triton.language as tl

from warploop.llm.mk.layout import step_rows
from warploop.llm.mk.numerics import mma, rnd
from warploop.runtime import device as wl

EPI_OUT = tl.constexpr(0)
EPI_RES = tl.constexpr(1)
EPI_SILU = tl.constexpr(2)


@triton.jit
def row_rstd(x, xs, brow, bmask, k, eps, BK: tl.constexpr):
    """1 / rms over k columns of x's rows `brow` (row stride xs), float32, brow's shape."""
    cols = tl.arange(0, BK)
    ss = tl.zeros(brow.shape, tl.float32)
    for k0 in range(0, k, BK):
        c = k0 + cols
        v = tl.load(x + brow.to(tl.int64)[:, None] * xs + c[None, :], mask=bmask[:, None] & (c < k)[None, :],
                    other=0.0).to(tl.float32)
        ss += tl.sum(v * v, axis=1)
    return tl.rsqrt(ss / k + eps)


@triton.jit
def x_chunk(x, xs, brow, bmask, c, k, norm_w, rstd, NORM: tl.constexpr, BACKEND: tl.constexpr):
    """x[brow, c] in the model dtype; with NORM, round(norm_w * round(x * rstd)) as layers.rms_norm."""
    v = tl.load(x + brow.to(tl.int64)[:, None] * xs + c[None, :], mask=bmask[:, None] & (c < k)[None, :], other=0.0)
    if NORM:
        dt = x.dtype.element_ty
        nw = tl.load(norm_w + c, mask=c < k, other=0.0).to(tl.float32)
        v = rnd(nw[None, :] * rnd(v.to(tl.float32) * rstd[:, None], dt, BACKEND).to(tl.float32), dt, BACKEND)
    return v


@triton.jit
def rows_product(w, k, rows, rmask, x, xs, b0, nb, norm_w, rstd, first, NORM: tl.constexpr,
                 HAS_FIRST: tl.constexpr, SINGLE: tl.constexpr, R: tl.constexpr, BN: tl.constexpr,
                 BK: tl.constexpr, BACKEND: tl.constexpr):
    """float32 [1, BN] (SINGLE: batch row b0 only) or [R, BN] (rows b0 .. b0 + R) of x @ w[rows]^T."""
    cols = tl.arange(0, BK)
    tile = w + rows.to(tl.int64)[:, None] * k + cols[None, :]
    wmask = rmask[:, None]
    if SINGLE:
        brow = b0 + 0 * rows          # row stride 0: x in the tile's [BN, BK] layout, no conversion
    else:
        brow = b0 + tl.arange(0, R)
    bmask = brow < nb
    if HAS_FIRST:
        wv = first
    else:
        wv = tl.load(tile, mask=wmask & (cols < k)[None, :], other=0.0)
    xv = x_chunk(x, xs, brow, bmask, cols, k, norm_w, rstd, NORM, BACKEND)
    if SINGLE:
        acc = wv.to(tl.float32) * xv.to(tl.float32)
    else:
        acc = mma(xv, tl.trans(wv), BACKEND)
    for k0 in range(BK, k, BK):
        c = k0 + cols
        wv = tl.load(tile + k0, mask=wmask & (c < k)[None, :], other=0.0, eviction_policy="evict_first")
        xv = x_chunk(x, xs, brow, bmask, c, k, norm_w, rstd, NORM, BACKEND)
        if SINGLE:
            acc += wv.to(tl.float32) * xv.to(tl.float32)
        else:
            acc += mma(xv, tl.trans(wv), BACKEND)
    if SINGLE:
        out = tl.sum(acc, axis=1)[None, :]
    else:
        out = acc
    return out


@triton.jit
def with_bias(acc, bias, rows, rmask, has_bias, dt: tl.constexpr, BACKEND: tl.constexpr):
    """round(acc + bias) in the model dtype, as float32 (F.linear's one rounding)."""
    if has_bias != 0:
        acc += tl.load(bias + rows, mask=rmask, other=0.0).to(tl.float32)[None, :]
    return rnd(acc, dt, BACKEND).to(tl.float32)


@triton.jit
def epilogue(acc, up_acc, bias, out, rows, rmask, bo, bmask, n_out, f, has_bias, dt: tl.constexpr,
             EPI: tl.constexpr, BACKEND: tl.constexpr):
    """Store a block's products [rows of bo, BN] by EPI (up_acc: the matching up rows, EPI_SILU only)."""
    mask = bmask[:, None] & rmask[None, :]
    if EPI == EPI_SILU:
        gate = with_bias(acc, bias, rows, rmask, has_bias, dt, BACKEND)
        up = with_bias(up_acc, bias, rows + f, rmask, has_bias, dt, BACKEND)
        act = rnd(gate * tl.sigmoid(gate), dt, BACKEND).to(tl.float32) * up
        tl.store(out + bo.to(tl.int64)[:, None] * f + rows[None, :], rnd(act, dt, BACKEND), mask=mask)
    elif EPI == EPI_RES:
        y = with_bias(acc, bias, rows, rmask, has_bias, dt, BACKEND)
        dst = out + bo.to(tl.int64)[:, None] * n_out + rows[None, :]
        y += tl.load(dst, mask=mask, other=0.0).to(tl.float32)
        tl.store(dst, rnd(y, dt, BACKEND), mask=mask)
    else:
        # rounded to the model dtype even into float32 logits: F.linear's output is in that dtype
        y = with_bias(acc, bias, rows, rmask, has_bias, dt, BACKEND)
        dst = out + bo.to(tl.int64)[:, None] * n_out + rows[None, :]
        tl.store(dst, rnd(y, out.dtype.element_ty, BACKEND), mask=mask)


@triton.jit
def block(w, bias, x, xs, norm_w, out, k, n_out, f, r, end, b0, nb, rstd, first, has_bias, NORM: tl.constexpr,
          EPI: tl.constexpr, HAS_FIRST: tl.constexpr, SINGLE: tl.constexpr, R: tl.constexpr, BN: tl.constexpr,
          BK: tl.constexpr, BACKEND: tl.constexpr):
    """One BN-row weight block for one batch block: products, then the epilogue's stores."""
    dt = w.dtype.element_ty
    rows = r + tl.arange(0, BN)
    rmask = rows < end
    acc = rows_product(w, k, rows, rmask, x, xs, b0, nb, norm_w, rstd, first, NORM, HAS_FIRST, SINGLE, R, BN, BK,
                       BACKEND)
    if SINGLE:
        bo = b0 + tl.arange(0, 1)
    else:
        bo = b0 + tl.arange(0, R)
    up_acc = acc
    if EPI == EPI_SILU:
        up_acc = rows_product(w, k, rows + f, rmask, x, xs, b0, nb, norm_w, rstd, first, NORM, False, SINGLE, R,
                              BN, BK, BACKEND)
    epilogue(acc, up_acc, bias, out, rows, rmask, bo, bo < nb, n_out, f, has_bias, dt, EPI, BACKEND)


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
    wl.wait(ctx, BACKEND)
    nb = step_rows(inp)
    if nb == 1:
        one = tl.arange(0, 1)
        rstd = tl.full([1], 1.0, tl.float32)
        if NORM:
            rstd = row_rstd(x, K, one, one < 1, K, eps, BK)
        gemv_stream(w, bias, x, norm_w, out, n_out, f, row0, end, 0, 1, rstd, a0, a1, a2, a3, a4, a5, a6, a7,
                    has_bias, NORM, EPI, True, K, R, BN, BK, DEPTH, BACKEND)
    else:
        for b0 in range(0, nb, R):
            brow = b0 + tl.arange(0, R)
            rstd = tl.full([R], 1.0, tl.float32)
            if NORM:
                rstd = row_rstd(x, K, brow, brow < nb, K, eps, BK)
            for r in range(row0, end, BN):
                block(w, bias, x, K, norm_w, out, K, n_out, f, r, end, b0, nb, rstd, a0, has_bias, NORM, EPI,
                      False, False, R, BN, BK, BACKEND)


@triton.jit
def gemv_node(ctx, inp, w, bias, x, norm_w, out, k, n_out, f, row0, count, eps, has_bias, NORM: tl.constexpr,
              EPI: tl.constexpr, R: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BACKEND: tl.constexpr):
    """Weight rows [row0, row0 + count) of a GEMV over k columns; x rows have stride k.

    out is the output (EPI_OUT, EPI_SILU: row stride n_out / f) or the residual (EPI_RES, stride
    n_out). For EPI_SILU, n_out = f: the gate rows; the up rows are f further down.
    """
    end = tl.minimum(row0 + count, n_out)
    rows = row0 + tl.arange(0, BN)
    cols = tl.arange(0, BK)
    first = tl.load(w + rows.to(tl.int64)[:, None] * k + cols[None, :], mask=(rows < end)[:, None] &
                    (cols < k)[None, :], other=0.0, eviction_policy="evict_first")
    wl.wait(ctx, BACKEND)
    nb = step_rows(inp)
    if nb == 1:
        one = tl.arange(0, 1)
        rstd = tl.full([1], 1.0, tl.float32)
        if NORM:
            rstd = row_rstd(x, k, one, one < 1, k, eps, BK)
        block(w, bias, x, k, norm_w, out, k, n_out, f, row0, end, 0, 1, rstd, first, has_bias, NORM, EPI, True,
              True, R, BN, BK, BACKEND)
        for r in range(row0 + BN, end, BN):
            block(w, bias, x, k, norm_w, out, k, n_out, f, r, end, 0, 1, rstd, first, has_bias, NORM, EPI, False,
                  True, R, BN, BK, BACKEND)
    else:
        # Batch blocks outer: each block's rstd once; the node's weights are re-read per block of
        # R rows (from L2 for a node's tens of KB), once per step for batches up to R.
        for b0 in range(0, nb, R):
            brow = b0 + tl.arange(0, R)
            rstd = tl.full([R], 1.0, tl.float32)
            if NORM:
                rstd = row_rstd(x, k, brow, brow < nb, k, eps, BK)
            for r in range(row0, end, BN):
                block(w, bias, x, k, norm_w, out, k, n_out, f, r, end, b0, nb, rstd, first, has_bias, NORM, EPI,
                      False, False, R, BN, BK, BACKEND)


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
def gemv_tile(ctx, inp, w, bias, x, norm_w, out, n_out, f, row0, eps, has_bias, NORM: tl.constexpr,
              EPI: tl.constexpr, K: tl.constexpr, TN: tl.constexpr, TK: tl.constexpr, AHEAD: tl.constexpr,
              R: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BACKEND: tl.constexpr):
    """One tile: weight rows [row0, row0 + TN) (EPI_SILU: and the up rows f further down) over the
    compile-time width K, in straight-line code (Plan.tile_kb: tens of KB a node).

    Batch 1: the tile is at most 8 chunks of [TN, TK] (layout.TILE_CHUNKS; EPI_SILU: gate chunks,
    then up chunks), all issued before anything waits on memory: the first AHEAD before `wl.wait`,
    the rest right after it, before x is read and its norm reduced (a reduction is a barrier, and
    no load is moved above one). So the whole tile is in flight at once. x (and its norm: rstd a
    scalar from one pass over x, then each chunk normalised as layers.rms_norm rounds it) is read
    per chunk through a row-stride-0 block in the tile's own layout, from L2. Products accumulate
    elementwise into [TN, TK] float32 and are reduced once. More rows: the tl.dot blocks of
    gemv_node_k."""
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
    wl.wait(ctx, BACKEND)
    end = tl.minimum(row0 + TN, n_out)
    nb = step_rows(inp)
    if nb == 1:
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
    else:
        for b0 in range(0, nb, R):
            brow = b0 + tl.arange(0, R)
            rstd = tl.full([R], 1.0, tl.float32)
            if NORM:
                rstd = row_rstd(x, K, brow, brow < nb, K, eps, BK)
            for r in range(row0, end, BN):
                block(w, bias, x, K, norm_w, out, K, n_out, f, r, end, b0, nb, rstd, a0, has_bias, NORM, EPI,
                      False, False, R, BN, BK, BACKEND)


@triton.jit
def gemv(ctx, inp, w, bias, x, norm_w, out, k, n_out, f, row0, count, eps, has_bias, NORM: tl.constexpr,
         EPI: tl.constexpr, K: tl.constexpr, R: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
         DEPTH: tl.constexpr, TN: tl.constexpr, TK: tl.constexpr, BACKEND: tl.constexpr):
    """A GEMV node: a tile of TN rows when the plan has tiles (gemv_tile), else a span of rows over
    the compile-time width K when the plan has one (gemv_node_k), else over the run-time width k
    (gemv_node)."""
    if TN != 0:
        gemv_tile(ctx, inp, w, bias, x, norm_w, out, n_out, f, row0, eps, has_bias, NORM, EPI, K, TN, TK, DEPTH, R, BN,
                  BK, BACKEND)
    elif K != 0:
        gemv_node_k(ctx, inp, w, bias, x, norm_w, out, n_out, f, row0, count, eps, has_bias, NORM, EPI, K, R, BN, BK,
                    DEPTH, BACKEND)
    else:
        gemv_node(ctx, inp, w, bias, x, norm_w, out, k, n_out, f, row0, count, eps, has_bias, NORM, EPI, R, BN, BK,
                  BACKEND)
