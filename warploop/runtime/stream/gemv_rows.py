"""The streaming kernel's GEMV tile against several rows (kinds.GEMV's batch), on tensor cores: the
consumer's body for a node of more than one row, in a kernel compiled with StreamConfig.batch_rows
(kernel.py dispatches to it; a batch-1 tile runs the consumer's own body)."""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, mma_v2

from warploop.runtime.stream.kinds import EPILOGUES, GEMV
from warploop.runtime.stream.sync import PUBLIC_REINTERPRET, TRACE_WORDS, now, waits
from warploop.runtime.stream.sync import barrier as _barrier

G_AMAX = gl.constexpr(GEMV.word("amax"))
G_OSTRIDE = gl.constexpr(GEMV.word("ostride"))
G_ASTRIDE = gl.constexpr(GEMV.word("astride"))
EPI_ADD = gl.constexpr(EPILOGUES["add"])
EPI_SILU = gl.constexpr(EPILOGUES["silu_mul"])


@gluon.jit
def _x_rows(arena, xrow, col, k, rowok, norm):
    """x's [NB, KS] block at columns `col` of every row (xrow: each row's start), straight from L2
    (a predecessor wrote it), zeros past k and past the node's rows; returns (raw, times the norm
    weights when the node has a norm)."""
    nw = gl.load(arena + norm + col, mask=(col < k) & (norm >= 0), other=0.0) + (norm < 0).to(gl.float32)
    xr = gl.load(arena + xrow[:, None] + col[None, :], mask=rowok[:, None] & (col < k)[None, :], other=0.0,
                 cache_modifier=".cg")
    return xr, xr * nw[None, :]


@gluon.jit
def gemv_rows(bufs, full, empty, it, base, arena, counters, err, epoch, failed, cta, i, trace, w0, n0, w1, n1,
               k, x, norm, eps, rows_n, out, bias, epi, narrow, nrows, BR: gl.constexpr, BK: gl.constexpr,
               NBUF: gl.constexpr, SPIN: gl.constexpr, TRACE: gl.constexpr, NB: gl.constexpr, CW: gl.constexpr):
    """A GEMV tile against `nrows` rows of x (kinds.GEMV's batch: row b at x + b * k, its outputs at
    out + b * ostride, its amax pair at amax + b * astride), on tensor cores: the rows are the M side
    of mma tiles (x's [NB, KS] blocks straight from L2 as a bf16 hi + lo pair, about 16 bits of the
    fp32), each half of the tile's weight rows the N side (read from the ring slot transposed, by
    ldmatrix), fp32 accumulation. Each row is RMS-normalised on its own, as batch 1: its sum of
    squares accumulates over the chunks and scales its sums at the end. Returns the ring's chunk
    count and `failed`."""
    HALF: gl.constexpr = BR // 2
    KS: gl.constexpr = 64                                   # a chunk's columns a step (x's registers)
    WM: gl.constexpr = NB // 16 if NB // 16 < CW else CW
    MB: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[WM, CW // WM], instr_shape=[16, 8])
    XA: gl.constexpr = gl.DotOperandLayout(0, MB, 2)
    WB: gl.constexpr = gl.DotOperandLayout(1, MB, 2)
    ostride = gl.load(base + G_OSTRIDE)
    astride = gl.load(base + G_ASTRIDE)
    amx = gl.load(base + G_AMAX)
    bx = gl.arange(0, NB, layout=gl.SliceLayout(1, XA))
    cx = gl.arange(0, KS, layout=gl.SliceLayout(0, XA))
    xrow = x + bx * k
    rowok = bx < nrows
    # the epilogue's indices (rows of the batch, the tile's output rows) and what no predecessor
    # writes, read before the wait: the bias
    bo = gl.arange(0, NB, layout=gl.SliceLayout(1, MB))
    ro = gl.arange(0, HALF, layout=gl.SliceLayout(0, MB))
    ma = (bo < nrows)[:, None] & (ro < rows_n)[None, :]
    mb = (bo < nrows)[:, None] & (ro + HALF < rows_n)[None, :]
    has_bias = (bias >= 0) & (epi != EPI_SILU)
    ba = gl.load(arena + bias + ro, mask=(ro < rows_n) & has_bias, other=0.0)[None, :]
    bb = gl.load(arena + bias + HALF + ro, mask=(ro + HALF < rows_n) & has_bias, other=0.0)[None, :]
    at_a = out + bo[:, None] * ostride + ro[None, :]
    failed = waits(counters, err, w0, n0, w1, n1, epoch, failed, cta, i, trace, SPIN, TRACE)
    add = epi == EPI_ADD
    old_a = ba + gl.load(arena + at_a, mask=ma & add, other=0.0, cache_modifier=".cg")
    old_b = bb + gl.load(arena + at_a + HALF, mask=mb & add, other=0.0, cache_modifier=".cg")
    acc_a = gl.zeros([NB, HALF], gl.float32, layout=MB)
    acc_b = gl.zeros([NB, HALF], gl.float32, layout=MB)
    ss = gl.zeros([NB], gl.float32, layout=gl.SliceLayout(1, XA))
    # chunk c holds the tile's two row halves at column block c, or a narrow tile's rows at column
    # blocks 2c (the top half) and 2c + 1 (the bottom half)
    c = 0
    while c < ((k + BK - 1) // BK + narrow) // (1 + narrow):
        slot = it % NBUF
        mbarrier.wait(full.index(slot), (it // NBUF) & 1)
        if TRACE:
            if c == 0:
                gl.store(trace + i * TRACE_WORDS + 2, now())
        # the slot as a plain row-major view (the same bytes): Triton 3.6 addresses a permuted view of
        # an unswizzled NVMMA layout as column-major (triton-lang/triton#10453)
        if PUBLIC_REINTERPRET:
            buf = bufs.index(slot).reinterpret(gl.bfloat16, [BR, BK],
                                               gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))
        else:
            buf = bufs.index(slot)._reinterpret(gl.bfloat16, [BR, BK], gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))
        for ks in gl.static_range(BK // KS):
            col = c * (1 + narrow) * BK + ks * KS + cx
            xr, xa = _x_rows(arena, xrow, col, k, rowok, norm)
            ss += gl.sum(xr * xr, axis=1)
            xh = xa.to(gl.bfloat16)
            xl = (xa - xh.to(gl.float32)).to(gl.bfloat16)
            wa = buf.slice(0, HALF).slice(ks * KS, KS, dim=1).permute((1, 0)).load(WB)      # [KS, HALF]
            acc_a = mma_v2(xl, wa, mma_v2(xh, wa, acc_a))
            if narrow:
                xr2, xb = _x_rows(arena, xrow, col + BK, k, rowok, norm)
                ss += gl.sum(xr2 * xr2, axis=1)
                xh = xb.to(gl.bfloat16)
                xl = (xb - xh.to(gl.float32)).to(gl.bfloat16)
            wb = buf.slice(HALF, HALF).slice(ks * KS, KS, dim=1).permute((1, 0)).load(WB)
            acc_b = mma_v2(xl, wb, mma_v2(xh, wb, acc_b))
        # every warp is done with the slot before one thread frees it
        _barrier()
        fence_async_shared()
        mbarrier.arrive(empty.index(slot))
        it += 1
        c += 1
    scale = gl.full([NB], 1.0, gl.float32, layout=gl.SliceLayout(1, XA))
    if norm >= 0:
        scale = gl.rsqrt(ss / k + eps)
    scale = gl.convert_layout(scale, gl.SliceLayout(1, MB))[:, None]
    if narrow:
        ya = old_a + scale * (acc_a + acc_b)
        yb = old_b
    else:
        ya = old_a + scale * acc_a
        yb = old_b + scale * acc_b
    if epi == EPI_SILU:
        gl.store(arena + at_a, ya / (1.0 + gl.exp(-ya)) * yb, mask=ma)
    else:
        gl.store(arena + at_a, ya, mask=ma)
        gl.store(arena + at_a + HALF, yb, mask=mb & (narrow == 0))
    if amx >= 0:                      # each row's largest output and its offset (the first of equal ones)
        va = gl.where(ma, ya, float("-inf"))
        vb = gl.where(mb & (narrow == 0), yb, float("-inf"))
        top = gl.maximum(gl.max(va, axis=1), gl.max(vb, axis=1))
        at = gl.minimum(gl.min(gl.where(va == top[:, None], at_a, 2 ** 30), axis=1),
                        gl.min(gl.where(vb == top[:, None], at_a + HALF, 2 ** 30), axis=1))
        gl.store(arena + amx + bo * astride, top, mask=bo < nrows)
        gl.store(arena + amx + bo * astride + 1, at.to(gl.float32), mask=bo < nrows)
    return it, failed
