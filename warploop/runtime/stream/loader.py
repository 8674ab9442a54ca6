"""The streaming kernel's loader role (kernel.py): one warp with a small register budget walks the
CTA's instruction list and streams every node's streamed operand (kinds.Streamed) into the ring of
NBUF shared-memory slots by TMA, waiting only for free slots, never on a dependency: a GEMV's weight
chunks (two boxes a chunk), an attention share's cached keys and values (attention.stream_kv)."""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from warploop.runtime.stream.attention import OP_ATTN, stream_kv
from warploop.runtime.stream.gemv_rows import SB
from warploop.runtime.stream.kinds import GEMV, WORDS, header_word
from warploop.runtime.stream.sync import PUBLIC_REINTERPRET, TRACE_WORDS, now
from warploop.runtime.stream.sync import tma_load as _tma_load

W = gl.constexpr(WORDS)
H_OP = gl.constexpr(header_word("op"))
OP_GEMV = gl.constexpr(GEMV.opcode)
G_POOL = gl.constexpr(GEMV.word(GEMV.streamed.pool))
G_ROW = gl.constexpr(GEMV.word(GEMV.streamed.row))
G_K = gl.constexpr(GEMV.word(GEMV.streamed.width))
G_ROW2 = gl.constexpr(GEMV.word(GEMV.streamed.second))
G_NARROW = gl.constexpr(GEMV.word("narrow"))
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
def loader(d0, d1, d2, d3, dkv, bufs, full, empty, instr, n, steps, ints, trace, BR: gl.constexpr, BK: gl.constexpr,
            NBUF: gl.constexpr, HD: gl.constexpr, KVT: gl.constexpr, NB: gl.constexpr, TRACE: gl.constexpr,
            AW: gl.constexpr):
    HALF: gl.constexpr = BR // 2
    it = 0
    op = gl.load(instr + H_OP)
    pool = gl.load(instr + G_POOL)
    row = gl.load(instr + G_ROW)
    row2 = gl.load(instr + G_ROW2)
    k = gl.load(instr + G_K)
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
        n_narrow = gl.load(nb + G_NARROW)
        if op == OP_GEMV:
            # a chunk is two [BR/2, BK] boxes: rows from row and from row2 at one column block, or
            # a narrow tile's BR/2 rows at two consecutive column blocks
            kk = 0
            blocked = (k * 0).to(gl.int64)     # ns (int64, as the clock)
            while kk < k:
                slot = it % NBUF
                if TRACE:
                    t = now()
                mbarrier.wait(empty.index(slot), ((it // NBUF) & 1) ^ 1)
                if TRACE:
                    blocked += now() - t
                    if kk == 0:
                        gl.store(trace + i * TRACE_WORDS + 4, now())
                bar = full.index(slot)
                mbarrier.expect(bar, BR * BK * 2)
                kk2 = kk + BK * narrow
                if NB > 0:            # a batched kernel's chunk: [BR, SB] swizzled column blocks (gemv_rows)
                    if PUBLIC_REINTERPRET:
                        dst = bufs.index(slot).reinterpret(gl.bfloat16, [2 * BK // SB, HALF, SB], d0.layout)
                    else:
                        dst = bufs.index(slot)._reinterpret(gl.bfloat16, [2 * BK // SB, HALF, SB], d0.layout)
                    for q in gl.static_range(BK // SB):
                        _tma_pair(d0, d1, d2, d3, pool, row, kk + q * SB, row2, kk2 + q * SB, bar,
                                  dst.index(2 * q), dst.index(2 * q + 1))
                else:
                    if PUBLIC_REINTERPRET:
                        dst = bufs.index(slot).reinterpret(gl.bfloat16, [2, HALF, BK], d0.layout)
                    else:
                        dst = bufs.index(slot)._reinterpret(gl.bfloat16, [2, HALF, BK], d0.layout)
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
        op, pool, row, row2, k, narrow = n_op, n_pool, n_row, n_row2, n_k, n_narrow
        j += 1
