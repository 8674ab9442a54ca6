"""Split-K GEMV tiles of the graphs of more than one row (Plan.split_rows).

A batch-1 tile (gemv_tile.py) is a few weight rows over the whole width: its x is one row, a few
KB. With B rows of x, those rows cost B times as much to read per tile, and at batch 32 a tile
of 4 rows of a 8,192-wide GEMV read 8 times its own weight bytes of x from L2. So here a node is
PN rows (64: tl.dot's operand) over one slice of the width, PC chunks of PK columns, every chunk
issued before `wl.wait` (the whole tile in flight, as at batch 1); x is read once per slice and
batch block, and multiplied against the tile through tl.dot, batch blocks of R rows outer so the
weights stay in registers.

A slice's products are partial sums: each node stores them in float32 to the graph's `work`
buffer, then counts itself in its row block's counter (`cnt`). The node that counts last sums
the slices in slice order (so every run adds them the same way: the bits do not depend on which
node came last), applies the epilogue, and sets the counter back to 0 for the next GEMV of the
step. Every consumer of a row block depends on all of its slices (graph.py), and the counter
orders the last slice's reads after the others' writes (release before the count, acquire after).

RMSNorm: a node holding one slice of x cannot reduce the whole row, and every node reading
the whole row would read B x hidden again per tile. So the nodes that write the residual stream
(embed, and the o_proj and down epilogues) also store each row block's sum of squares in
`work`; a reader adds those PR sums per row (in block order) for its rstd.

work: float32 [batch, PR] sums of squares, then (from 64-float alignment) [slices, batch, NT]
partial sums, NT the GEMV's output rows (gate_up: 2 f, the up rows f further on).
"""
from __future__ import annotations

import triton
import triton.language as tl

from warploop.llm.mk.gemv import EPI_RES, EPI_SILU, epilogue, with_bias, x_chunk
from warploop.llm.mk.gemv_tile import pick
from warploop.llm.mk.layout import D_BATCH, step_rows
from warploop.llm.mk.numerics import mma, rnd
from warploop.runtime import device as wl


@triton.jit
def split_chunk(w, i: tl.constexpr, row0, n_out, f, k0, K: tl.constexpr, PN: tl.constexpr, PK: tl.constexpr,
                PC: tl.constexpr):
    """Chunk i of a tile: rows [row0, row0 + PN) (the up rows f further down for i >= PC), columns
    k0 + (i % PC) * PK onwards; loaded now. Columns are masked only where slices overrun K."""
    rows = row0 + tl.arange(0, PN)
    cols = k0 + (i % PC) * PK + tl.arange(0, PK)
    ptr = w + (rows + (i // PC) * f).to(tl.int64)[:, None] * K + cols[None, :]
    if K % (PC * PK) != 0:
        v = tl.load(ptr, mask=(rows < n_out)[:, None] & (cols < K)[None, :], other=0.0, eviction_policy="evict_first")
    else:
        v = tl.load(ptr, mask=(rows < n_out)[:, None], other=0.0, eviction_policy="evict_first")
    return v


@triton.jit
def parts_of(work, inp, PR: tl.constexpr):
    """The partial sums' region of `work` (after the batch's sums of squares)."""
    return work + (tl.load(inp + D_BATCH) * PR + 63) // 64 * 64


@triton.jit
def ss_rstd(work, brow, bmask, K: tl.constexpr, eps, PR: tl.constexpr):
    """1 / rms of the residual rows brow: their PR row blocks' sums of squares, added in order."""
    j = tl.arange(0, triton.next_power_of_2(PR))
    ss = tl.load(work + brow[:, None] * PR + j[None, :], mask=bmask[:, None] & (j < PR)[None, :], other=0.0)
    return tl.rsqrt(tl.sum(ss, axis=1) / K + eps)


@triton.jit
def residual_epilogue(acc, bias, res, work, rows, rmask, bo, bmask, n_out, rb, has_bias, dt: tl.constexpr,
                      PR: tl.constexpr, BACKEND: tl.constexpr):
    """res[bo, rows] += round(acc + bias), rounded as layers.py does, and the row block's sums of
    squares of the new residual for the next RMSNorm."""
    mask = bmask[:, None] & rmask[None, :]
    dst = res + bo.to(tl.int64)[:, None] * n_out + rows[None, :]
    y = with_bias(acc, bias, rows, rmask, has_bias, dt, BACKEND) + tl.load(dst, mask=mask, other=0.0).to(tl.float32)
    y = rnd(y, dt, BACKEND)
    tl.store(dst, y, mask=mask)
    v = tl.where(mask, y.to(tl.float32), 0.0)
    tl.store(work + bo * PR + rb, tl.sum(v * v, axis=1), mask=bmask)


@triton.jit
def finish(acc, gate, bias, out, work, rows, rmask, bo, bmask, n_out, f, rb, has_bias, dt: tl.constexpr,
           EPI: tl.constexpr, PR: tl.constexpr, BACKEND: tl.constexpr):
    """The epilogue of a row block's whole products acc (EPI_SILU: the up rows', gate the gate rows')."""
    if EPI == EPI_RES:
        residual_epilogue(acc, bias, out, work, rows, rmask, bo, bmask, n_out, rb, has_bias, dt, PR, BACKEND)
    elif EPI == EPI_SILU:
        epilogue(gate, acc, bias, out, rows, rmask, bo, bmask, n_out, f, has_bias, dt, EPI, BACKEND)
    else:
        epilogue(acc, acc, bias, out, rows, rmask, bo, bmask, n_out, f, has_bias, dt, EPI, BACKEND)


@triton.jit
def gemv_split(ctx, inp, w, bias, x, norm_w, out, work, cnt, n_out, f, tile, eps, has_bias, NORM: tl.constexpr,
               EPI: tl.constexpr, K: tl.constexpr, KN: tl.constexpr, PN: tl.constexpr, PK: tl.constexpr,
               PC: tl.constexpr, PR: tl.constexpr, R: tl.constexpr, BACKEND: tl.constexpr):
    """Node `tile` of a split-K GEMV over width K: row block tile // PS, slice tile % PS (PS slices
    of PC chunks of PK columns). out is the output (EPI_OUT, EPI_SILU: f gate rows, then the up
    rows) or the residual (EPI_RES). KN: the width the norm's mean is over (the hidden size)."""
    SUB: tl.constexpr = 2 if EPI == EPI_SILU else 1
    NCH: tl.constexpr = SUB * PC
    PS: tl.constexpr = (K + PC * PK - 1) // (PC * PK)
    NT = n_out * SUB          # rows of the partial sums: gate then up (n_out = f for EPI_SILU)
    tl.static_assert(NCH <= 8)
    rb = tile // PS
    split = tile % PS
    row0 = rb * PN
    k0 = split * (PC * PK)
    a0 = split_chunk(w, 0, row0, n_out, f, k0, K, PN, PK, PC)
    a1 = a0
    a2 = a0
    a3 = a0
    a4 = a0
    a5 = a0
    a6 = a0
    a7 = a0
    if NCH > 1:
        a1 = split_chunk(w, 1, row0, n_out, f, k0, K, PN, PK, PC)
    if NCH > 2:
        a2 = split_chunk(w, 2, row0, n_out, f, k0, K, PN, PK, PC)
    if NCH > 3:
        a3 = split_chunk(w, 3, row0, n_out, f, k0, K, PN, PK, PC)
    if NCH > 4:
        a4 = split_chunk(w, 4, row0, n_out, f, k0, K, PN, PK, PC)
    if NCH > 5:
        a5 = split_chunk(w, 5, row0, n_out, f, k0, K, PN, PK, PC)
    if NCH > 6:
        a6 = split_chunk(w, 6, row0, n_out, f, k0, K, PN, PK, PC)
    if NCH > 7:
        a7 = split_chunk(w, 7, row0, n_out, f, k0, K, PN, PK, PC)
    nb = step_rows(inp)       # fixed for the run: read before the wait, whose acquire empties L1
    parts = parts_of(work, inp, PR)
    batch = tl.load(inp + D_BATCH)
    wl.wait(ctx, BACKEND)
    dt = w.dtype.element_ty
    rows = row0 + tl.arange(0, PN)
    rmask = rows < n_out
    for b0 in range(0, nb, R):
        bo = b0 + tl.arange(0, R)
        bmask = bo < nb
        rstd = tl.full([R], 1.0, tl.float32)
        if NORM:
            rstd = ss_rstd(work, bo, bmask, KN, eps, PR)
        acc = tl.zeros([R, PN], tl.float32)
        gate = acc
        for i in tl.static_range(NCH):
            c = k0 + (i % PC) * PK + tl.arange(0, PK)
            xv = x_chunk(x, K, bo, bmask, c, K, norm_w, rstd, NORM, BACKEND)
            acc += mma(xv, tl.trans(pick(i, a0, a1, a2, a3, a4, a5, a6, a7)), BACKEND)
            if SUB == 2 and i == PC - 1:
                gate = acc
                acc = tl.zeros([R, PN], tl.float32)
        if PS == 1:
            finish(acc, gate, bias, out, work, rows, rmask, bo, bmask, n_out, f, rb, has_bias, dt, EPI, PR, BACKEND)
        else:
            mask = bmask[:, None] & rmask[None, :]
            dst = parts + (split * batch + bo).to(tl.int64)[:, None] * NT + rows[None, :]
            if SUB == 2:
                tl.store(dst, gate, mask=mask)
                tl.store(dst + n_out, acc, mask=mask)
            else:
                tl.store(dst, acc, mask=mask)
    if PS > 1:
        tl.debug_barrier()        # every thread's partial sums before the count (a release)
        if tl.atomic_add(cnt + rb, 1, sem="acq_rel", scope="gpu") == PS - 1:
            tl.debug_barrier()
            tl.store(cnt + rb, 0)
            for b0 in range(0, nb, R):
                bo = b0 + tl.arange(0, R)
                bmask = bo < nb
                mask = bmask[:, None] & rmask[None, :]
                acc = tl.zeros([R, PN], tl.float32)
                gate = acc
                for s in tl.static_range(PS):
                    src = parts + (s * batch + bo).to(tl.int64)[:, None] * NT + rows[None, :]
                    acc += tl.load(src + (SUB - 1) * n_out, mask=mask, other=0.0, cache_modifier=".cg")
                    if SUB == 2:
                        gate += tl.load(src, mask=mask, other=0.0, cache_modifier=".cg")
                finish(acc, gate, bias, out, work, rows, rmask, bo, bmask, n_out, f, rb, has_bias, dt, EPI, PR,
                       BACKEND)
