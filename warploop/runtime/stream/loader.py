"""The streaming kernel's loader role (kernel.py): one warp with a small register budget walks the
CTA's instruction list and streams every node's streamed operand (kinds.Streamed) into the ring of
NBUF shared-memory slots by TMA, waiting only for free slots, never on a dependency: a GEMV's weight
chunks (two boxes a chunk), an attention share's cached keys and values (stream_kv)."""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from warploop.runtime.stream.gemv_rows import SB
from warploop.runtime.stream.kinds import ATTN, GEMV, WORDS, header_word
from warploop.runtime.stream.shares import share
from warploop.runtime.stream.sync import TRACE_WORDS, now
from warploop.runtime.stream.sync import tma_load as _tma_load

W = gl.constexpr(WORDS)
H_OP = gl.constexpr(header_word("op"))
OP_GEMV = gl.constexpr(GEMV.opcode)
G_POOL = gl.constexpr(GEMV.word(GEMV.streamed.pool))
G_ROW = gl.constexpr(GEMV.word(GEMV.streamed.row))
G_K = gl.constexpr(GEMV.word(GEMV.streamed.width))
G_ROW2 = gl.constexpr(GEMV.word(GEMV.streamed.second))
G_COL = gl.constexpr(GEMV.word(GEMV.streamed.col))
G_NARROW = gl.constexpr(GEMV.word("narrow"))
G_TALL = gl.constexpr(GEMV.word("tall"))
OP_ATTN = gl.constexpr(ATTN.opcode)
A_BLOCKS = gl.constexpr(ATTN.word("blocks"))
A_BS = gl.constexpr(ATTN.word("bs"))
A_KVHEAD = gl.constexpr(ATTN.word("kvhead"))
A_LAYER = gl.constexpr(ATTN.word("layer"))
A_SPLIT = gl.constexpr(ATTN.word("split"))
A_SPLITS = gl.constexpr(ATTN.word("splits"))
A_STEP = gl.constexpr(ATTN.word("step"))
LOADER_WARPS = gl.constexpr(1)
LOADER_REGS = gl.constexpr(40)


@gluon.jit
def _tma_pair(d0, d1, d2, d3, pool, row, col, row2, col2, bar, top, bottom):
    """A chunk's two boxes from weight pool `pool`: (row, col) into `top`, (row2, col2) into `bottom`."""
    if pool == 0:
        _tma_load(d0, [row, col], bar, top)
        _tma_load(d0, [row2, col2], bar, bottom)
    elif pool == 1:
        _tma_load(d1, [row, col], bar, top)
        _tma_load(d1, [row2, col2], bar, bottom)
    elif pool == 2:
        _tma_load(d2, [row, col], bar, top)
        _tma_load(d2, [row2, col2], bar, bottom)
    else:
        _tma_load(d3, [row, col], bar, top)
        _tma_load(d3, [row2, col2], bar, bottom)


@gluon.jit
def _stream_tall(d0, d1, d2, d3, bufs, full, empty, it, pool, row, row2, k, col, narrow, tall, trace, i,
                 BR: gl.constexpr, BK: gl.constexpr, NBUF: gl.constexpr, TRACE: gl.constexpr):
    """A batched GEMV tile's chunks in a kernel with tall tiles (StreamConfig.gemv_tall): a plain tile's
    chunk (rows from row and row2 at one column block, or a narrow tile's at two), or a tall tile's
    two slots at one column block, pool rows [row, row + BR) then [row2, row2 + BR) (kinds.GEMV tall)."""
    HALF: gl.constexpr = BR // 2
    kk = col
    blocked = (k * 0).to(gl.int64)
    while kk < col + k:
        sub = 0
        while sub < 1 + tall:
            slot = it % NBUF
            if TRACE:
                t = now()
            mbarrier.wait(empty.index(slot), ((it // NBUF) & 1) ^ 1)
            if TRACE:
                blocked += now() - t
                if (kk == col) & (sub == 0):
                    gl.store(trace + i * TRACE_WORDS + 4, now())
            bar = full.index(slot)
            mbarrier.expect(bar, BR * BK * 2)
            top = row + sub * (row2 - row)        # a tall tile's slot: BR consecutive rows
            bottom = gl.where(tall != 0, top + HALF, row2)
            kk2 = kk + BK * narrow
            dst = bufs.index(slot).reinterpret(gl.bfloat16, [2 * BK // SB, HALF, SB], d0.layout)
            for q in gl.static_range(BK // SB):
                _tma_pair(d0, d1, d2, d3, pool, top, kk + q * SB, bottom, kk2 + q * SB, bar, dst.index(2 * q),
                          dst.index(2 * q + 1))
            it += 1
            sub += 1
        kk += BK * (1 + narrow)
    if TRACE:
        gl.store(trace + i * TRACE_WORDS + 5, blocked)
    return it


@gluon.jit
def stream_kv(dkv, bufs, full, empty, base, ints, it, s, trace, i, NBUF: gl.constexpr, HD: gl.constexpr,
              KVT: gl.constexpr, TRACE: gl.constexpr, AW: gl.constexpr):
    """The loader's part of an ATTN node at step s of the launch: its share of the cached context
    into the ring (rows this launch wrote are streamed too, stale: the consumer patches them). A box past
    the share is loaded from row -KVB: out of bounds, so zeros and no traffic, and every chunk
    carries its whole byte count (an mbarrier's expected bytes are a compile-time constant). A
    chunk). With TRACE, the ns it waited for free slots go to the node's trace word 5. A box of a
    head's 64-column block (attn_wgmma: KW 64): NHB boxes a row of boxes, and over head_dim 64 a
    chunk's keys fill one slot and its values the next (StreamConfig.kv_split)."""
    KVB: gl.constexpr = dkv.block_type.shape[0]
    KW: gl.constexpr = dkv.block_type.shape[1]
    NHB: gl.constexpr = HD // KW
    KS: gl.constexpr = AW and KVT * HD == bufs.shape[1] * bufs.shape[2]   # kv_split: keys' slot, values' next
    NSUB: gl.constexpr = KVT // KVB
    layer = gl.load(base + A_LAYER)
    blocks = gl.load(base + A_BLOCKS)
    bs = gl.load(base + A_BS)
    col = gl.load(base + A_KVHEAD) * HD
    step = gl.load(base + A_STEP)
    split = gl.load(base + A_SPLIT)
    splits = gl.load(base + A_SPLITS)
    lo, hi = share(gl.load(ints + step + 1) + s, split, splits, KVT)
    krow = layer * 2 * blocks * bs          # the cache's rows: [layers, 2, blocks, bs] flattened
    vrow = krow + blocks * bs
    # the block ids of a chunk's boxes come in one load, each box's picked out by a lane reduction
    IL: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    jb = gl.arange(0, NSUB, layout=IL)
    t0 = lo
    tb = t0 + jb * KVB
    ids = gl.load(ints + step + 3 + tb // bs, mask=tb < hi, other=0)
    blocked = (lo * 0).to(gl.int64)     # ns (int64, as the clock)
    while t0 < hi:
        tn = t0 + KVT + jb * KVB         # the next chunk's block ids, in flight while this one issues
        n_ids = gl.load(ints + step + 3 + tn // bs, mask=tn < hi, other=0)
        for half in gl.static_range(2 if KS else 1):   # kv_split: the keys' slot, then the values'
            slot = it % NBUF
            if TRACE:
                tw = now()
            mbarrier.wait(empty.index(slot), ((it // NBUF) & 1) ^ 1)
            if TRACE:
                blocked += now() - tw
            bar = full.index(slot)
            if KS:
                mbarrier.expect(bar, KVT * HD * 2)
                view = bufs.index(slot).reinterpret(gl.bfloat16, [NHB * NSUB, KVB, KW], dkv.layout)
                for j in gl.static_range(NSUB):
                    t = t0 + j * KVB
                    r = gl.sum(gl.where(jb == j, ids, 0), axis=0) * bs + t % bs
                    at = gl.where(t < hi, krow + half * (vrow - krow) + r, -KVB)
                    for c in gl.static_range(NHB):
                        _tma_load(dkv, [at, col + c * KW], bar, view.index(c * NSUB + j))
            else:
                mbarrier.expect(bar, 2 * KVT * HD * 2)
                view = bufs.index(slot).reinterpret(gl.bfloat16, [2 * NSUB, KVB, HD], dkv.layout)
                for j in gl.static_range(NSUB):
                    t = t0 + j * KVB
                    ok = t < hi
                    r = gl.sum(gl.where(jb == j, ids, 0), axis=0) * bs + t % bs
                    _tma_load(dkv, [gl.where(ok, krow + r, -KVB), col], bar, view.index(j))
                    _tma_load(dkv, [gl.where(ok, vrow + r, -KVB), col], bar, view.index(NSUB + j))
            it += 1
        t0 += KVT
        ids = n_ids
    if TRACE:
        gl.store(trace + i * TRACE_WORDS + 5, blocked)
    return it


@gluon.jit
def loader(d0, d1, d2, d3, dkv, bufs, full, empty, instr, n, steps, ints, trace, BR: gl.constexpr, BK: gl.constexpr,
            NBUF: gl.constexpr, HD: gl.constexpr, KVT: gl.constexpr, NB: gl.constexpr, TRACE: gl.constexpr,
            AW: gl.constexpr, TT: gl.constexpr):
    HALF: gl.constexpr = BR // 2
    SK: gl.constexpr = NB > 0 and BR == 64      # split-K tiles (kinds.GEMV col): a batched kernel of 64-row tiles
    it = 0
    op = gl.load(instr + H_OP)
    pool = gl.load(instr + G_POOL)
    row = gl.load(instr + G_ROW)
    row2 = gl.load(instr + G_ROW2)
    k = gl.load(instr + G_K)
    col = 0
    if SK:
        col = gl.load(instr + G_COL)
    narrow = gl.load(instr + G_NARROW)
    # instruction j of the launch is instruction j % n of step j // n (a decode loop runs the list
    # `steps` times; the ring's chunk count runs on across steps)
    j = 0
    while j < n * steps:          # the next instruction's words load while this one streams
        i = j % n
        nb = instr + ((j + 1) % n) * W
        n_op = gl.load(nb + H_OP)
        n_pool = gl.load(nb + G_POOL)
        n_row = gl.load(nb + G_ROW)
        n_row2 = gl.load(nb + G_ROW2)
        n_k = gl.load(nb + G_K)
        n_col = 0
        if SK:
            n_col = gl.load(nb + G_COL)
        n_narrow = gl.load(nb + G_NARROW)
        if TT:                        # a constexpr branch: tall tiles compiled in (StreamConfig.gemv_tall)
            if op == OP_GEMV:
                it = _stream_tall(d0, d1, d2, d3, bufs, full, empty, it, pool, row, row2, k, col, narrow,
                                  gl.load(instr + i * W + G_TALL), trace, i, BR, BK, NBUF, TRACE)
        elif op == OP_GEMV:
            # a chunk is two [BR/2, BK] boxes: rows from row and from row2 at one column block, or
            # a narrow tile's BR/2 rows at two consecutive column blocks; columns [col, col + k)
            kk = col
            blocked = (k * 0).to(gl.int64)     # ns (int64, as the clock)
            while kk < col + k:
                slot = it % NBUF
                if TRACE:
                    t = now()
                mbarrier.wait(empty.index(slot), ((it // NBUF) & 1) ^ 1)
                if TRACE:
                    blocked += now() - t
                    if kk == col:
                        gl.store(trace + i * TRACE_WORDS + 4, now())
                bar = full.index(slot)
                mbarrier.expect(bar, BR * BK * 2)
                kk2 = kk + BK * narrow
                if NB > 0:            # a batched kernel's chunk: [BR, SB] swizzled column blocks (gemv_rows)
                    dst = bufs.index(slot).reinterpret(gl.bfloat16, [2 * BK // SB, HALF, SB], d0.layout)
                    for q in gl.static_range(BK // SB):
                        _tma_pair(d0, d1, d2, d3, pool, row, kk + q * SB, row2, kk2 + q * SB, bar,
                                  dst.index(2 * q), dst.index(2 * q + 1))
                else:
                    dst = bufs.index(slot).reinterpret(gl.bfloat16, [2, HALF, BK], d0.layout)
                    _tma_pair(d0, d1, d2, d3, pool, row, kk, row2, kk2, bar, dst.index(0), dst.index(1))
                it += 1
                kk += BK * (1 + narrow)
            if TRACE:
                gl.store(trace + i * TRACE_WORDS + 5, blocked)
        if HD != 0:
            if op == OP_ATTN:
                if TRACE:
                    gl.store(trace + i * TRACE_WORDS + 4, now())
                it = stream_kv(dkv, bufs, full, empty, instr + i * W, ints, it, j // n, trace, i, NBUF, HD, KVT,
                              TRACE, AW)
        op, pool, row, row2, k, col, narrow = n_op, n_pool, n_row, n_row2, n_k, n_col, n_narrow
        j += 1
