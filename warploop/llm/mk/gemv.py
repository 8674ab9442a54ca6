"""GEMV tile bodies of the decode graph: out[b, rows] = epilogue(prologue(x[b]) @ w[rows]^T).

Here: the pieces every GEMV node shares (the norm prologue, the epilogues, tl.dot blocks for
batches), and `gemv_node` over a run-time width (the CPU plan). Over a compile-time width (the GPU
plan) a node is a tile (gemv_tile.py); tasks.py's `gemv` picks one.

A run-time-width node owns `count` weight rows (a multiple of BN) and every live batch row. Its first weight
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
def rows_chunk(acc, tile, wmask, k0, cols, k, x, xs, brow, bmask, norm_w, rstd, NORM: tl.constexpr,
               SINGLE: tl.constexpr, BACKEND: tl.constexpr):
    """acc plus the products of columns [k0, k0 + BK) (one step of rows_product's k-loop)."""
    c = k0 + cols
    wv = tl.load(tile + k0, mask=wmask & (c < k)[None, :], other=0.0, eviction_policy="evict_first")
    xv = x_chunk(x, xs, brow, bmask, c, k, norm_w, rstd, NORM, BACKEND)
    if SINGLE:
        acc += wv.to(tl.float32) * xv.to(tl.float32)
    else:
        acc += mma(xv, tl.trans(wv), BACKEND)
    return acc


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
        acc = rows_chunk(acc, tile, wmask, k0, cols, k, x, xs, brow, bmask, norm_w, rstd, NORM, SINGLE, BACKEND)
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
def batch_blocks(w, bias, x, norm_w, out, k, n_out, f, row0, end, nb, eps, first, has_bias, NORM: tl.constexpr,
                 EPI: tl.constexpr, R: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BACKEND: tl.constexpr):
    """Weight rows [row0, end) for nb > 1 live rows, through tl.dot: batch blocks of R rows outer,
    so each block's rstd is computed once; the node's weights are re-read per block (from L2 for
    a node's tens of KB), once per step for batches up to R. x rows have stride k."""
    for b0 in range(0, nb, R):
        brow = b0 + tl.arange(0, R)
        rstd = tl.full([R], 1.0, tl.float32)
        if NORM:
            rstd = row_rstd(x, k, brow, brow < nb, k, eps, BK)
        for r in range(row0, end, BN):
            block(w, bias, x, k, norm_w, out, k, n_out, f, r, end, b0, nb, rstd, first, has_bias, NORM, EPI, False,
                  False, R, BN, BK, BACKEND)


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
    nb = step_rows(inp)     # fixed for the run: read before the wait, whose acquire empties L1
    wl.wait(ctx, BACKEND)
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
        batch_blocks(w, bias, x, norm_w, out, k, n_out, f, row0, end, nb, eps, first, has_bias, NORM, EPI, R, BN, BK,
                     BACKEND)
