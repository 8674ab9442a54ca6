"""The streaming kernel's GEMV tile against several rows (kinds.GEMV's batch), on tensor cores: the
consumer's body for every GEMV in a kernel compiled with StreamConfig.batch_rows (kernel.py
dispatches to it).

In such a kernel the ring holds a chunk as BK // SB column blocks of [BR, SB] bf16, 128-byte
swizzled (the loader's TMA boxes are [BR/2, SB], StreamConfig.weight_box), so the mma's operand
loads (ldmatrix) hit every bank once. x comes into shared memory by cp.async, a column block of
every row a stage, XS stages ahead of the mmas (StreamConfig.x_stages), so its L2 round trip
overlaps the chunks before. x is CAST nodes' bf16 rows (kinds.CAST), normalised already, so the
mmas take them as they land. With tiles of 64 rows
(block_rows 64) the warpgroup multiplies on wgmma, both operands read from shared memory as they
lie: the ring's [64, 64] swizzled column blocks (M: the tile's rows) against x's [NB, 64] blocks,
stored 128-byte swizzled for it and read transposed (N: the batch's rows); no ldmatrix, no
registers between them."""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    mma_v2,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from warploop.runtime.stream.kinds import EPILOGUES, GEMV
from warploop.runtime.stream.sync import TRACE_WORDS, now, waits
from warploop.runtime.stream.sync import barrier as _barrier
from warploop.runtime.stream.sync import cp_async as _cp_async

G_AMAX = gl.constexpr(GEMV.word("amax"))
G_OSTRIDE = gl.constexpr(GEMV.word("ostride"))
G_ASTRIDE = gl.constexpr(GEMV.word("astride"))
G_OBF = gl.constexpr(GEMV.word("obf"))
G_XK = gl.constexpr(GEMV.word("xk"))
G_TALL = gl.constexpr(GEMV.word("tall"))
EPI_ADD = gl.constexpr(EPILOGUES["add"])
EPI_SILU = gl.constexpr(EPILOGUES["silu_mul"])
SB = gl.constexpr(64)          # a swizzled column block: 128 bytes of bf16, the TMA swizzle's span


@gluon.jit
def _xb_fetch(stage, q, nblk, xb, xrow, cols, k, rowok, BK: gl.constexpr, ZF: gl.constexpr = False):
    """Start the copy of x's column block q (of nblk) of every row into `stage` (q's), 16 bytes (8
    values) a copy, and close the cp.async group (an empty one past the last block, so a group is
    always a block; with ZF, zeros there): .cg, from L2 (a predecessor on another SM wrote x; L1
    may hold a stale line), zeros past k and the rows."""
    if ZF:
        col = q * BK + cols
        _cp_async(stage, xb + xrow + col, mask=rowok & (col < k // 8 * 8), cache_modifier=".cg")
    elif q < nblk:
        col = q * BK + cols
        _cp_async(stage, xb + xrow + col, mask=rowok & (col < k // 8 * 8), cache_modifier=".cg")
    async_copy.commit_group()


@gluon.jit
def _out_rows(arena, xbp, ya, yb, at_a, out, bo, ro, ostride, ma, mb, obf, epi, narrow, HALF: gl.constexpr):
    """A tile's outputs from its halves' sums ya, yb ([NB, HALF], the old values and bias added):
    bf16 from element 2 * out (obf: a next GEMV's input as they are, kinds.GEMV obf) or fp32 at at_a;
    silu_mul's silu(ya) * yb, or both halves (a narrow tile's ya alone)."""
    if obf != 0:
        at_o = 2 * out + bo[:, None] * ostride + ro[None, :]
        if epi == EPI_SILU:
            gl.store(xbp + at_o, (ya / (1.0 + gl.exp(-ya)) * yb).to(gl.bfloat16), mask=ma)
        else:
            gl.store(xbp + at_o, ya.to(gl.bfloat16), mask=ma)
            gl.store(xbp + at_o + HALF, yb.to(gl.bfloat16), mask=mb & (narrow == 0))
    elif epi == EPI_SILU:
        gl.store(arena + at_a, ya / (1.0 + gl.exp(-ya)) * yb, mask=ma)
    else:
        gl.store(arena + at_a, ya, mask=ma)
        gl.store(arena + at_a + HALF, yb, mask=mb & (narrow == 0))


@gluon.jit
def _row_max(ya, yb, ma, mb, at_a, narrow, HALF: gl.constexpr):
    """Each batch row's largest output of a tile's halves and its arena offset (the first of equal ones)."""
    va = gl.where(ma, ya, float("-inf"))
    vb = gl.where(mb & (narrow == 0), yb, float("-inf"))
    top = gl.maximum(gl.max(va, axis=1), gl.max(vb, axis=1))
    at = gl.minimum(gl.min(gl.where(va == top[:, None], at_a, 2 ** 30), axis=1),
                    gl.min(gl.where(vb == top[:, None], at_a + HALF, 2 ** 30), axis=1))
    return top, at


@gluon.jit
def gemv_rows(bufs, full, empty, xs, it, base, arena, counters, err, epoch, failed, cta, i, trace, w0, n0, w1, n1,
              k, x, rows_n, out, bias, epi, narrow, nrows, BR: gl.constexpr, BK: gl.constexpr,
              NBUF: gl.constexpr, SPIN: gl.constexpr, TRACE: gl.constexpr, NB: gl.constexpr, CW: gl.constexpr,
              XS: gl.constexpr, WP: gl.constexpr, TT: gl.constexpr):
    """A GEMV tile against `nrows` rows of x (kinds.GEMV's batch: CAST nodes' bf16 rows, normalised,
    row b's bf16 values from element 2 * x + b * xk; its outputs at out + b * ostride, its amax pair
    at amax + b * astride), on tensor cores: the rows are the M side of mma tiles, the tile's BR
    weight rows the N side (on wgmma, tiles of 64 rows: the other way round), fp32 accumulation. A
    narrow tile (its rows at two consecutive column blocks a chunk) takes the top half's sums
    against one x block and the bottom's against the next. Returns the ring's chunk count and
    `failed`. WP (StreamConfig.wgmma_pipe, wgmma tiles with 4 or more stages of x): a chunk's products
    are issued before the chunk before's are waited for, and that chunk's slot and x stages are freed
    then (one chunk of products in flight behind the loads). TT (StreamConfig.gemv_tall): a tall tile
    (kinds.GEMV tall) multiplies each x block against two slots, into accw and accw2."""
    HALF: gl.constexpr = BR // 2
    WG: gl.constexpr = BR == 64         # wgmma: the warpgroup's products from shared memory (docstring)
    NKS: gl.constexpr = BK // SB       # column slabs a chunk: a warp's own (K split over the warps)
    WK: gl.constexpr = NKS if NKS < CW else CW
    MB: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[WK, 1, CW // WK],
                                                 instr_shape=[1, 16, 8])
    XA: gl.constexpr = gl.DotOperandLayout(0, MB, 2)               # [NKS, NB, SB]: x
    WB: gl.constexpr = gl.DotOperandLayout(1, MB, 2)               # [NKS, SB, BR]: the weights
    # the epilogue's [NB, HALF] halves
    EL: gl.constexpr = gl.BlockedLayout([1, 1], [32 // HALF, HALF], [CW, 1], [1, 0])
    WSL: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=3)
    # x: 8 values a 16-byte copy (cp.async); its stages, [NKS, NB, SB] each, 16-byte groups swizzled by
    # row, so the mma operand's 8 rows at a time hit 8 bank groups
    CPB: gl.constexpr = gl.BlockedLayout([1, 1, 8], [1, 4, 8], [WK, CW // WK, 1], [2, 1, 0])
    XSB: gl.constexpr = gl.SwizzledSharedLayout(8, 1, 8, order=[2, 1, 0])
    # WG: wgmma's operands, 128-byte swizzled rows of 64 values (x's stages as [XS * NKS, NB, SB] and the
    # slot as [NKS, BR, SB]: an operand is one [rows, SB] block of either)
    NVS: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    # wgmma's accumulator: the tile's rows (M) by the batch's (N), over the warpgroup
    ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[CW, 1], instr_shape=[16, NB, 16])
    # xs: XS stages of x
    if WG:                            # the same bytes as [XS, NKS, NB, SB] for the copies and as [XS * NKS, NB, SB]
        NVS3: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=3)
        xqb = xs.slice(0, XS * NB // 2).reinterpret(gl.bfloat16, [XS * NKS, NB, SB], NVS)
        xqf = xs.slice(0, XS * NB // 2).reinterpret(gl.bfloat16, [XS, NKS, NB, SB], NVS3)
    else:
        xqb = xs.slice(0, XS * NB // 2).reinterpret(gl.bfloat16, [XS, NKS, NB, SB], XSB)
    kb = gl.arange(0, NKS, layout=gl.SliceLayout(1, gl.SliceLayout(2, CPB)))
    bb_ = gl.arange(0, NB, layout=gl.SliceLayout(0, gl.SliceLayout(2, CPB)))
    jb = gl.arange(0, SB, layout=gl.SliceLayout(0, gl.SliceLayout(1, CPB)))
    colsb = kb[:, None, None] * SB + jb[None, None, :]
    # row b's bf16 values from element 2 * x + b * xk (the rows' stride: k, or a split-K tile's pool
    # width; a multiple of 8, so rows are 16-byte aligned: program.gemv checks)
    if WG:                            # split-K tiles come in kernels of 64-row tiles only (kinds.GEMV col, xk)
        xrowb = gl.multiple_of(2 * x + bb_ * gl.load(base + G_XK), 8)[None, :, None]
    else:
        xrowb = gl.multiple_of(2 * x + bb_ * k, 8)[None, :, None]
    rowokb = (bb_ < nrows)[None, :, None]
    xbp = arena.to(gl.pointer_type(gl.bfloat16), bitcast=True)
    ostride = gl.load(base + G_OSTRIDE)
    astride = gl.load(base + G_ASTRIDE)
    obf = gl.load(base + G_OBF)
    amx = gl.load(base + G_AMAX)
    tall = 0
    if TT:
        tall = gl.load(base + G_TALL)
    wcol = gl.arange(0, BR, layout=gl.SliceLayout(0, gl.SliceLayout(0, MB)))
    # the epilogue's indices (rows of the batch, a half's output rows) and what no predecessor
    # writes, read before the wait: the bias
    bo = gl.arange(0, NB, layout=gl.SliceLayout(1, EL))
    ro = gl.arange(0, HALF, layout=gl.SliceLayout(0, EL))
    ma = (bo < nrows)[:, None] & (ro < rows_n)[None, :]
    mb = (bo < nrows)[:, None] & (ro + HALF < rows_n)[None, :]
    has_bias = (bias >= 0) & (epi != EPI_SILU)
    ba = gl.load(arena + bias + ro, mask=(ro < rows_n) & has_bias, other=0.0)[None, :]
    bb = gl.load(arena + bias + HALF + ro, mask=(ro + HALF < rows_n) & has_bias, other=0.0)[None, :]
    at_a = out + bo[:, None] * ostride + ro[None, :]
    failed = waits(counters, err, w0, n0, w1, n1, epoch, failed, cta, i, trace, SPIN, TRACE)
    nblk = (k + BK - 1) // BK
    add = epi == EPI_ADD
    old_a = ba + gl.load(arena + at_a, mask=ma & add, other=0.0, cache_modifier=".cg")
    old_b = bb + gl.load(arena + at_a + HALF, mask=mb & add, other=0.0, cache_modifier=".cg")
    acc = gl.zeros([NKS, NB, BR], gl.float32, layout=MB)
    acc2 = gl.zeros([NKS, NB, BR], gl.float32, layout=MB)     # a narrow tile's bottom half
    accw = gl.zeros([BR, NB], gl.float32, layout=ACC)         # WG: the tile's sums, and a narrow one's
    accw2 = gl.zeros([BR, NB], gl.float32, layout=ACC)        # against the next x block
    # chunk c holds the tile's two row halves at x block c, or a narrow tile's rows at blocks 2c
    # (the top half) and 2c + 1 (the bottom half); blocks up to XS past the chunk's first are in flight
    issued = 0
    c = 0
    if TRACE:
        dwait = (k * 0).to(gl.int64)  # ns waiting for chunks after the first (TRACE_STAMPS data_wait)
    if WP:                            # every stage filled first, then a chunk's once its products are done (zeros
        while issued < XS:            # past x's end: a narrow tile's last chunk multiplies its second block)
            _xb_fetch(xqf.index(issued % XS), issued, nblk, xbp, xrowb, colsb, k, rowokb, BK, True)
            issued += 1
    while c < (nblk + narrow) // (1 + narrow):
        qa = c * (1 + narrow)
        if WP:                        # blocks [qa, qa + 1 + narrow) are in: XS - 2 (XS - 4) blocks ahead of them
            if narrow:
                async_copy.wait_group(XS - 4)
            else:
                async_copy.wait_group(XS - 2)
        else:
            while issued < qa + XS:   # a stage is free once the block before in it was read
                if WG:
                    _xb_fetch(xqf.index(issued % XS), issued, nblk, xbp, xrowb, colsb, k, rowokb, BK)
                else:
                    _xb_fetch(xqb.index(issued % XS), issued, nblk, xbp, xrowb, colsb, k, rowokb, BK)
                issued += 1
            if narrow:
                async_copy.wait_group(XS - 2)
            else:
                async_copy.wait_group(XS - 1)
        _barrier()                    # every thread's copies are in before any thread reads them
        if WG:
            fence_async_shared()      # cp.async wrote x through the generic proxy; wgmma reads through the async one
        slot = it % NBUF
        if TRACE:
            tw = now()
        mbarrier.wait(full.index(slot), (it // NBUF) & 1)
        if TRACE:
            if c == 0:
                gl.store(trace + i * TRACE_WORDS + 2, now())
            else:
                dwait += now() - tw
        wq = bufs.index(slot).reinterpret(gl.bfloat16, [NKS, BR, SB], WSL)
        if WP:                        # this chunk's products issued, then the chunk before's waited for
            ww = bufs.index(slot).reinterpret(gl.bfloat16, [NKS, BR, SB], NVS)
            if narrow:                # (each branch waits: an accumulator in flight cannot cross a branch)
                for j in gl.static_range(NKS):
                    accw = warpgroup_mma(ww.index(j), xqb.index(qa % XS * NKS + j).permute((1, 0)), accw,
                                         is_async=True)
                for j in gl.static_range(NKS):
                    accw2 = warpgroup_mma(ww.index(j), xqb.index((qa + 1) % XS * NKS + j).permute((1, 0)), accw2,
                                          is_async=True)
                accw, accw2 = warpgroup_mma_wait(num_outstanding=2 * NKS, deps=(accw, accw2))
            else:
                for j in gl.static_range(NKS):
                    accw = warpgroup_mma(ww.index(j), xqb.index(qa % XS * NKS + j).permute((1, 0)), accw,
                                         is_async=True)
                accw = warpgroup_mma_wait(num_outstanding=NKS, deps=(accw,))
            # every warp is done with the chunk before's slot and x stages: one thread frees the slot,
            # and the stages take the blocks XS on
            _barrier()
            if c > 0:
                mbarrier.arrive(empty.index((it + NBUF - 1) % NBUF))
            while issued < qa + XS:
                _xb_fetch(xqf.index(issued % XS), issued, nblk, xbp, xrowb, colsb, k, rowokb, BK, True)
                issued += 1
        elif WG:                      # every column block: the tile's rows [BR, SB] by x's transposed [SB, NB]
            ww = bufs.index(slot).reinterpret(gl.bfloat16, [NKS, BR, SB], NVS)
            for j in gl.static_range(NKS):
                accw = warpgroup_mma(ww.index(j), xqb.index(qa % XS * NKS + j).permute((1, 0)), accw, is_async=True)
            accw = warpgroup_mma_wait(num_outstanding=0, deps=(accw,))
            if narrow:
                if qa + 1 < nblk:     # no block past x's end was copied
                    for j in gl.static_range(NKS):
                        accw2 = warpgroup_mma(ww.index(j), xqb.index((qa + 1) % XS * NKS + j).permute((1, 0)), accw2)
            if TT:                    # a tall tile's second slot: the same x block against rows [row2, row2 + BR)
                if tall:
                    mbarrier.wait(full.index((it + 1) % NBUF), ((it + 1) // NBUF) & 1)
                    ww2 = bufs.index((it + 1) % NBUF).reinterpret(gl.bfloat16, [NKS, BR, SB], NVS)
                    for j in gl.static_range(NKS):
                        accw2 = warpgroup_mma(ww2.index(j), xqb.index(qa % XS * NKS + j).permute((1, 0)), accw2)
        else:                         # the mmas take the bf16 rows as they are; each warp its slab:
            wt = wq.permute((0, 2, 1)).load(WB)          # x [NB, SB] against the tile's rows [SB, BR]
            acc = mma_v2(xqb.index(qa % XS).load(XA), wt, acc)
            if narrow:
                xb2 = xqb.index((qa + 1) % XS).load(XA)
                acc2 = mma_v2(gl.where(qa + 1 < nblk, xb2, gl.zeros_like(xb2)), wt, acc2)
        if not WP:
            # every warp is done with the slot and the x stages before one thread frees the slot (and
            # before the next chunk's copies reuse the stages); no proxy fence: nothing here wrote the slot
            _barrier()
            mbarrier.arrive(empty.index(slot))
            if TT:
                if tall:
                    mbarrier.arrive(empty.index((it + 1) % NBUF))
                    it += 1
        it += 1
        c += 1
    if WP:                            # the last chunk's products, then its slot
        accw, accw2 = warpgroup_mma_wait(num_outstanding=0, deps=(accw, accw2))
        _barrier()
        if c > 0:
            mbarrier.arrive(empty.index((it + NBUF - 1) % NBUF))
    async_copy.wait_group(0)
    if TRACE:
        gl.store(trace + i * TRACE_WORDS + 6, dwait)
    # the sums go through shared memory (stage 0, free now) into the epilogue's halves: a narrow
    # tile's output row r is its top half's column r plus its bottom half's column r + HALF
    # the slabs' sums added across the warps
    ys = xs.slice(0, NB).reinterpret(gl.float32, [NB, BR], gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))
    if WG:
        wrow = gl.arange(0, BR, layout=gl.SliceLayout(1, ACC))
        ys.permute((1, 0)).store(gl.where((wrow < HALF)[:, None] | (narrow == 0), accw, accw2))
    else:
        ys.store(gl.where((wcol < HALF)[None, :] | (narrow == 0), gl.sum(acc, axis=0), gl.sum(acc2, axis=0)))
    if TT:                            # a tall tile's second slot's sums beside the first's
        ys2 = xs.slice(NB, NB).reinterpret(gl.float32, [NB, BR], gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))
        if tall:
            ys2.permute((1, 0)).store(accw2)
    _barrier()
    ya = ys.slice(0, HALF, dim=1).load(EL)
    yb = ys.slice(HALF, HALF, dim=1).load(EL)
    if TT:
        # silu_mul: the gate rows in ys, the up rows in ys2, outputs [0, HALF) then [HALF, BR); a store:
        # rows [0, BR) in ys, [BR, 2 BR) in ys2
        ya2 = ys2.slice(0, HALF, dim=1).load(EL)
        yb2 = ys2.slice(HALF, HALF, dim=1).load(EL)
        if tall & (epi == EPI_SILU):
            ya2 = ys.slice(HALF, HALF, dim=1).load(EL)
            yb2 = ys2.slice(HALF, HALF, dim=1).load(EL)
            yb = ys2.slice(0, HALF, dim=1).load(EL)
    _barrier()                        # every thread has its sums before the stage is x again
    if narrow:
        ya = old_a + (ya + yb)
        yb = old_b
    else:
        ya = old_a + ya
        yb = old_b + yb
    # (with TT the outputs go through _out_rows and _row_max; without it the same code stays inline, as
    # the kernels were timed: through the helpers their SASS moves under Triton 3.6.0. One path goes once
    # gemv_tall is timed.)
    if TT:
        # a tall tile's second 64 outputs (silu_mul) or BR rows, at `off` (masked off in a plain tile)
        off = gl.where(epi == EPI_SILU, HALF, BR)
        ma2 = (bo < nrows)[:, None] & (ro + off < rows_n)[None, :] & (tall != 0)
        mb2 = (bo < nrows)[:, None] & (ro + off + HALF < rows_n)[None, :] & (tall != 0)
        ba2 = gl.load(arena + bias + off + ro, mask=(ro + off < rows_n) & has_bias & (tall != 0), other=0.0)[None, :]
        bb2 = gl.load(arena + bias + off + HALF + ro, mask=(ro + off + HALF < rows_n) & has_bias & (tall != 0),
                      other=0.0)[None, :]
        ya2 = ya2 + ba2 + gl.load(arena + at_a + off, mask=ma2 & add, other=0.0, cache_modifier=".cg")
        yb2 = yb2 + bb2 + gl.load(arena + at_a + off + HALF, mask=mb2 & add, other=0.0, cache_modifier=".cg")
        _out_rows(arena, xbp, ya, yb, at_a, out, bo, ro, ostride, ma, mb, obf, epi, narrow, HALF)
        if tall:                      # out: a float offset, bf16 rows (obf) two values a float
            _out_rows(arena, xbp, ya2, yb2, at_a + off, out + gl.where(obf != 0, off // 2, off), bo, ro, ostride, ma2,
                      mb2, obf, epi, narrow, HALF)
        if amx >= 0:                  # each row's largest output and its offset (the first of equal ones; the
            top, at = _row_max(ya, yb, ma, mb, at_a, narrow, HALF)      # second part's rows come after the first's)
            top2, at2 = _row_max(ya2, yb2, ma2, mb2, at_a + off, narrow, HALF)
            at = gl.where(top2 > top, at2, at)
            top = gl.maximum(top, top2)
            gl.store(arena + amx + bo * astride, top, mask=bo < nrows)
            gl.store(arena + amx + bo * astride + 1, at.to(gl.float32), mask=bo < nrows)
    else:
        if obf != 0:                  # bf16 outputs, a next GEMV's input as they are (kinds.GEMV obf)
            at_o = 2 * out + bo[:, None] * ostride + ro[None, :]
            if epi == EPI_SILU:
                gl.store(xbp + at_o, (ya / (1.0 + gl.exp(-ya)) * yb).to(gl.bfloat16), mask=ma)
            else:
                gl.store(xbp + at_o, ya.to(gl.bfloat16), mask=ma)
                gl.store(xbp + at_o + HALF, yb.to(gl.bfloat16), mask=mb & (narrow == 0))
        elif epi == EPI_SILU:
            gl.store(arena + at_a, ya / (1.0 + gl.exp(-ya)) * yb, mask=ma)
        else:
            gl.store(arena + at_a, ya, mask=ma)
            gl.store(arena + at_a + HALF, yb, mask=mb & (narrow == 0))
        if amx >= 0:                  # each row's largest output and its offset (the first of equal ones)
            va = gl.where(ma, ya, float("-inf"))
            vb = gl.where(mb & (narrow == 0), yb, float("-inf"))
            top = gl.maximum(gl.max(va, axis=1), gl.max(vb, axis=1))
            at = gl.minimum(gl.min(gl.where(va == top[:, None], at_a, 2 ** 30), axis=1),
                            gl.min(gl.where(vb == top[:, None], at_a + HALF, 2 ** 30), axis=1))
            gl.store(arena + amx + bo * astride, top, mask=bo < nrows)
            gl.store(arena + amx + bo * astride + 1, at.to(gl.float32), mask=bo < nrows)
    return it, failed
