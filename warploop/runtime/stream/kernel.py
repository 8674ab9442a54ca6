"""The streaming executor's kernel, in Gluon (Hopper: TMA, mbarriers, warp specialization).

One CTA per SM runs its static instruction list (program.py builds it) with three roles:

- the loader (loader.py), one warp with a small register budget, walks the list and streams every
  node's streamed operand (kinds.Streamed) into a ring of NBUF shared-memory slots of [BR, BK] by
  TMA. It waits only for free slots, never on a dependency, so it runs ahead into later stages;
- the consumer, one warpgroup, walks the same list: it waits on the node's dependency counters
  (bounded acquire polls), stages the node's input vector in shared memory, computes from
  the ring chunk by chunk, releases each slot, writes its outputs and hands its counter to
- the publisher, one warp, which publishes it with a GPU-scope release atomic once the consumer's
  stores are in (an mbarrier pair a publish, PQ deep), so the release's fence is off the consumer's
  path.

Ring protocol: chunk number `it` (counted alike by both roles) lives in slot it % NBUF, and
(it // NBUF) & 1 is the parity of that slot's use. full[slot] completes when TMA has written the
chunk (expect-tx); empty[slot] when the consumer has read it. A fresh mbarrier passes a wait for
parity 1, so the loader's first pass over the ring does not block.

Counters only grow: run `epoch` (0-based) of a wait on (counter, need) is met at need * (epoch + 1).
A wait that polls SPIN times in vain records (1, counter, CTA, instruction) in err and stops
waiting from then on, so the kernel always ends and the host raises with those words (sync.py).
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

from warploop.runtime.stream.attention import OP_ATTN, attn
from warploop.runtime.stream.gemv_rows import gemv_rows
from warploop.runtime.stream.kinds import EPILOGUES, GEMV, WORDS, header_word
from warploop.runtime.stream.loader import LOADER_REGS, LOADER_WARPS, loader
from warploop.runtime.stream.sampling import gumbel
from warploop.runtime.stream.small import small
from warploop.runtime.stream.sync import TRACE_WORDS, now, waits
from warploop.runtime.stream.sync import barrier as _barrier

W = gl.constexpr(WORDS)
H_OP = gl.constexpr(header_word("op"))
H_WAIT0 = gl.constexpr(header_word("wait0"))
H_NEED0 = gl.constexpr(header_word("need0"))
H_WAIT1 = gl.constexpr(header_word("wait1"))
H_NEED1 = gl.constexpr(header_word("need1"))
H_SIGNAL = gl.constexpr(header_word("signal"))
H_SIGNALS = gl.constexpr(header_word("signals"))
OP_GEMV = gl.constexpr(GEMV.opcode)
G_K = gl.constexpr(GEMV.word(GEMV.streamed.width))
G_ROWS = gl.constexpr(GEMV.word("rows"))
G_X = gl.constexpr(GEMV.word("x"))
G_OUT = gl.constexpr(GEMV.word("out"))
G_NORM = gl.constexpr(GEMV.word("norm"))
G_BIAS = gl.constexpr(GEMV.word("bias"))
G_EPI = gl.constexpr(GEMV.word("epi"))
G_EPS = gl.constexpr(GEMV.word("eps"))
G_NARROW = gl.constexpr(GEMV.word("narrow"))
G_AMAX = gl.constexpr(GEMV.word("amax"))
G_BATCH = gl.constexpr(GEMV.word("batch"))
G_SAMP = gl.constexpr(GEMV.word("samp"))
EPI_ADD = gl.constexpr(EPILOGUES["add"])
EPI_SILU = gl.constexpr(EPILOGUES["silu_mul"])
CW = gl.constexpr(4)            # the consumer's warps: one warpgroup (two measured no faster)
PUBLISHER_WARPS = gl.constexpr(1)
PQ = gl.constexpr(4)            # publishes the consumer may hand the publisher ahead of it


@gluon.jit
def _words(base):
    """The words of the instruction at `base` the consumer reads: the header (not the signal count:
    the publisher's), then the GEMV fields."""
    return (gl.load(base + H_OP), gl.load(base + H_WAIT0), gl.load(base + H_NEED0), gl.load(base + H_WAIT1),
            gl.load(base + H_NEED1), gl.load(base + H_SIGNAL), gl.load(base + G_K),
            gl.load(base + G_X), gl.load(base + G_NORM), gl.load(base + G_EPS).to(gl.float32, bitcast=True),
            gl.load(base + G_ROWS), gl.load(base + G_OUT), gl.load(base + G_BIAS), gl.load(base + G_EPI),
            gl.load(base + G_NARROW))


@gluon.jit
def _consumer(bufs, full, empty, xs, instr, n, steps, arena, ints, kv, emb, counters, err, epoch0, cta, trace,
              peers, BR: gl.constexpr,
              BK: gl.constexpr, NBUF: gl.constexpr, KMAX: gl.constexpr, SPIN: gl.constexpr, TRACE: gl.constexpr,
              HD: gl.constexpr, GP: gl.constexpr, TILE: gl.constexpr, KVT: gl.constexpr, NB: gl.constexpr,
              XS: gl.constexpr, TP: gl.constexpr, AW: gl.constexpr, WP: gl.constexpr, TT: gl.constexpr, pub_full,
              pub_empty):
    HALF: gl.constexpr = BR // 2
    XB: gl.constexpr = NB > 0         # a batched kernel's GEMVs read CAST nodes' bf16 rows: CAST compiled in
    SK: gl.constexpr = XB and BR == 64   # split-K tiles and CAST's merge of their partials compiled in (kinds.GEMV)
    # A thread holds 8 contiguous bf16 (16 B) of a row and a warp 256 contiguous columns, so the
    # unswizzled chunk is read without bank conflicts and a row's sum stays inside a warp.
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (BK // 8), BK // 8], [CW, 1], [1, 0])
    rows = gl.arange(0, HALF, layout=gl.SliceLayout(1, layout))
    # x is staged as [KMAX // BK, BK] and read back through a [KMAX // BK, 1, BK] view of the same
    # bytes: chunk c is then a [1, BK] tile in the chunks' own layout
    xl: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [CW, 1], [1, 0])
    xb1 = xs.slice(0, KMAX // BK)     # a batched kernel's xs holds more rows (its stages of x)
    xrows = xb1.reinterpret(gl.float32, [KMAX // BK, 1, BK], xs.layout)
    xidx = (gl.arange(0, KMAX // BK, layout=gl.SliceLayout(1, xl))[:, None] * BK
            + gl.arange(0, BK, layout=gl.SliceLayout(0, xl))[None, :])
    it = 0
    npub = 0
    failed = 0
    staged_x = -1
    staged_norm = -2
    staged_k = -1
    scale = 1.0               # the staged input's RMSNorm scale (1: no norm)
    # The instruction's words are loaded one instruction ahead (off the critical path). While
    # loops, not range(): Triton 3.6 drops a loop-carried scalar from the outer loop when its only
    # use is an inner range() bound.
    op, w0, n0, w1, n1, sig, k, x, norm, eps, rows_n, out, bias, epi, narrow = _words(instr)
    j = 0
    while j < n * steps:          # instruction j % n of step j // n: run epoch0 + j // n of the program
        i = j % n
        s = j // n
        epoch = epoch0 + s
        nb = instr + ((j + 1) % n) * W
        (n_op, n_w0, n_n0, n_w1, n_n1, n_sig, n_k, n_x, n_norm, n_eps, n_rows, n_out, n_bias, n_epi,
         n_narrow) = _words(nb)
        if op == OP_GEMV:
            if NB > 0:                # a batched kernel (its ring's chunks are gemv_rows'): every GEMV there (the
                # batch-1 body below is compiled into batch-1 kernels only)
                nrows = gl.load(instr + i * W + G_BATCH)
                it, failed = gemv_rows(bufs, full, empty, xs, it, instr + i * W, arena, counters, err, epoch,
                                       failed, cta, i, trace, w0, n0, w1, n1, k, x, rows_n, out, bias,
                                       epi, narrow, nrows, BR, BK, NBUF, SPIN, TRACE, NB, CW, XS, WP, TT)
                staged_x = -1
            else:
                amx = gl.load(instr + i * W + G_AMAX)
                restage = (w0 >= 0) | (w1 >= 0) | (x != staged_x) | (norm != staged_norm) | (k != staged_k)
                ma = rows < rows_n
                mb = rows + HALF < rows_n
                # what no predecessor writes is read before the wait: the norm weights and the bias
                # x, the norm weights and k are 16-byte aligned (program.gemv checks it): vector loads
                k4 = k // 4 * 4
                nw = gl.load(arena + (norm // 4 * 4 + xidx), mask=(xidx < k4) & (norm >= 0) & restage, other=0.0)
                has_bias = (bias >= 0) & (epi != EPI_SILU)
                ba = gl.load(arena + bias + rows, mask=ma & has_bias, other=0.0)
                bb = gl.load(arena + bias + HALF + rows, mask=mb & has_bias, other=0.0)
                failed = waits(counters, err, w0, n0, w1, n1, epoch, failed, cta, i, trace, SPIN, TRACE)
                # the accumulator's old value is a predecessor's output: read it right after the wait,
                # so its round trip overlaps the staging and the chunks. .cg: L2, never a stale L1 line
                add = epi == EPI_ADD
                old_a = ba + gl.load(arena + out + rows, mask=ma & add, other=0.0, cache_modifier=".cg")
                old_b = bb + gl.load(arena + out + HALF + rows, mask=mb & add, other=0.0, cache_modifier=".cg")
                # RMSNorm is linear in x after its scalar: x * nw is staged at once, and rsqrt(mean(x^2)
                # + eps) scales the row sums after the last chunk, so the cross-warp reduction of x^2 is
                # off the path to the first chunk
                ss_rows = gl.zeros([KMAX // BK], gl.float32, layout=gl.SliceLayout(1, xl))
                if restage:
                    xv = gl.load(arena + (x // 4 * 4 + xidx), mask=xidx < k4, other=0.0, cache_modifier=".cg")
                    if norm >= 0:
                        ss_rows = gl.sum(xv * xv, axis=1)
                        xv = xv * nw
                    _barrier()            # every thread is done with the previous x
                    xb1.store(xv)
                    _barrier()
                    staged_x = x
                    staged_norm = norm
                    staged_k = k
                # products accumulate elementwise; the rows are summed across lanes once, after the
                # last chunk (a cross-lane reduction per chunk costs more than the chunk's FMAs)
                part_a = gl.zeros([HALF, BK], gl.float32, layout=layout)
                part_b = gl.zeros([HALF, BK], gl.float32, layout=layout)
                # a narrow tile's chunk c holds x chunks 2c (rows in part_a) and 2c + 1 (part_b); a
                # chunk past x's end is zeros in the ring and in the staged x
                c = 0
                if TRACE:
                    dwait = (k * 0).to(gl.int64)  # ns waiting for chunks after the first (data_wait)
                while c < ((k + BK - 1) // BK + narrow) // (1 + narrow):
                    slot = it % NBUF
                    xc = xrows.index(c * (1 + narrow)).load(layout)          # [1, BK]: broadcast over the rows
                    xd = xc
                    if narrow:
                        xd = xrows.index(gl.minimum(2 * c + 1, KMAX // BK - 1)).load(layout)
                    if TRACE:
                        tw = now()
                    mbarrier.wait(full.index(slot), (it // NBUF) & 1)
                    if TRACE:
                        if c == 0:
                            gl.store(trace + i * TRACE_WORDS + 2, now())
                        else:
                            dwait += now() - tw
                    buf = bufs.index(slot)
                    wa = buf.slice(0, HALF).load(layout)
                    wb = buf.slice(HALF, HALF).load(layout)
                    part_a += wa.to(gl.float32) * xc
                    part_b += wb.to(gl.float32) * xd
                    # every warp is done with the slot before one thread frees it (the arrive orders
                    # these reads before the loader's next TMA write into it: no proxy fence, as
                    # nothing here wrote the slot)
                    _barrier()
                    mbarrier.arrive(empty.index(slot))
                    it += 1
                    c += 1
                if TRACE:
                    gl.store(trace + i * TRACE_WORDS + 6, dwait)
                if restage:
                    scale = 1.0
                    if norm >= 0:
                        scale = gl.rsqrt(gl.sum(ss_rows, axis=0) / k + eps)
                if narrow:
                    acc_a = old_a + scale * (gl.sum(part_a, axis=1) + gl.sum(part_b, axis=1))
                    acc_b = old_b
                else:
                    acc_a = old_a + scale * gl.sum(part_a, axis=1)
                    acc_b = old_b + scale * gl.sum(part_b, axis=1)
                if epi == EPI_SILU:
                    y = acc_a / (1.0 + gl.exp(-acc_a)) * acc_b
                    gl.store(arena + out + rows, y, mask=ma)
                else:
                    gl.store(arena + out + rows, acc_a, mask=ma)
                    gl.store(arena + out + HALF + rows, acc_b, mask=mb)
                if amx >= 0:              # the tile's largest output and its offset (the first of equal ones)
                    va = gl.where(ma, acc_a, float("-inf"))
                    vb = gl.where(mb, acc_b, float("-inf"))
                    smp = gl.load(instr + i * W + G_SAMP)
                    if smp >= 0:          # a sampled row: the race values y / T + G (kinds.GEMV, sampling.py)
                        temp = gl.load(ints + smp).to(gl.float32, bitcast=True)
                        if temp > 0:
                            lo = gl.load(ints + smp + 1)
                            hi = gl.load(ints + smp + 2)
                            ctx = gl.load(ints + smp + 3) + s
                            tb = gl.load(ints + smp + 4)
                            va = gl.where(ma, acc_a / temp + gumbel(lo, hi, ctx, out + rows + tb), float("-inf"))
                            vb = gl.where(mb, acc_b / temp + gumbel(lo, hi, ctx, out + HALF + rows + tb), float("-inf"))
                    top = gl.maximum(gl.max(va, axis=0), gl.max(vb, axis=0))
                    at = gl.minimum(gl.min(gl.where(va == top, out + rows, 2 ** 30), axis=0),
                                    gl.min(gl.where(vb == top, out + HALF + rows, 2 ** 30), axis=0))
                    gl.store(arena + amx, top)
                    gl.store(arena + amx + 1, at.to(gl.float32))
                if (out < staged_x + staged_k) & (out + BR > staged_x):
                    staged_x = -1         # this node wrote over the staged input
        else:
            if HD != 0:               # attention compiled in (a constexpr branch: no body without it)
                if op == OP_ATTN:
                    it, failed = attn(arena, ints, kv, instr + i * W, bufs, full, empty, xs, it, counters, err, epoch,
                                      s, failed, cta, i, trace, w0, n0, w1, n1, NBUF, SPIN, TRACE, CW, HD, GP, TILE,
                                      KVT, XB, AW)
                else:
                    failed = small(op, arena, ints, emb, instr + i * W, xidx, s, counters, err, w0, n0, w1, n1,
                                    epoch, failed, cta, i, trace, peers, SPIN, TRACE, CW, TP, XB, SK, KMAX, HD)
            else:
                failed = small(op, arena, ints, emb, instr + i * W, xidx, s, counters, err, w0, n0, w1, n1, epoch,
                                failed, cta, i, trace, peers, SPIN, TRACE, CW, TP, XB, SK, KMAX, HD)
            staged_x = -1             # an attention or embedding node's output may be a later node's input
        if sig >= 0:
            # every thread's stores precede one thread's CTA-scope release to the publisher, whose
            # GPU-scope release atomic is cumulative over them; the consumer goes on meanwhile
            _barrier()
            q = npub % PQ
            mbarrier.wait(pub_empty.index(q), ((npub // PQ) & 1) ^ 1)
            mbarrier.arrive(pub_full.index(q))
            npub += 1
        if TRACE:
            gl.store(trace + i * TRACE_WORDS + 3, now())
        op, w0, n0, w1, n1, sig = n_op, n_w0, n_n0, n_w1, n_n1, n_sig
        k, x, norm, eps, rows_n, out, bias, epi = n_k, n_x, n_norm, n_eps, n_rows, n_out, n_bias, n_epi
        narrow = n_narrow
        j += 1


@gluon.jit
def _publisher(instr, n, steps, counters, pub_full, pub_empty):
    """The publisher: walks the list as the consumer does and publishes each counter it signals:
    once the consumer's stores are in (pub_full[q], a CTA-scope release by the consumer after its
    barrier), one GPU-scope release atomic (cumulative over them), then frees q (pub_empty), so the
    consumer never waits on the release's fence (H200, Llama-3.2-1B step: 0.914 -> 0.891 ms)."""
    npub = 0
    sig = gl.load(instr + H_SIGNAL)
    sigs = gl.load(instr + H_SIGNALS)
    j = 0
    while j < n * steps:
        nb = instr + ((j + 1) % n) * W
        n_sig = gl.load(nb + H_SIGNAL)
        n_sigs = gl.load(nb + H_SIGNALS)
        if sig >= 0:
            q = npub % PQ
            mbarrier.wait(pub_full.index(q), (npub // PQ) & 1)
            gl.atomic_add(counters + sig, sigs, sem="release", scope="gpu")
            mbarrier.arrive(pub_empty.index(q))
            npub += 1
        sig, sigs = n_sig, n_sigs
        j += 1


@gluon.jit(do_not_specialize=["epoch", "steps"])
def stream_kernel(d0, d1, d2, d3, dkv, instr, table, arena, ints, kv, emb, counters, err, epoch, steps, trace, peers,
                  BR: gl.constexpr,
                  BK: gl.constexpr, NBUF: gl.constexpr, KMAX: gl.constexpr, SPIN: gl.constexpr,
                  TRACE: gl.constexpr, HD: gl.constexpr, GP: gl.constexpr, TILE: gl.constexpr, KVT: gl.constexpr,
                  NB: gl.constexpr, XS: gl.constexpr, XR: gl.constexpr, TP: gl.constexpr, AW: gl.constexpr,
                  WP: gl.constexpr, TT: gl.constexpr):
    cta = gl.program_id(0)
    first = gl.load(table + 2 * cta)
    n = gl.load(table + 2 * cta + 1)
    mine = instr + first * W
    bufs = gl.allocate_shared_memory(gl.bfloat16, [NBUF, BR, BK], d0.layout)
    # the staged input: a batch-1 GEMV's x (KMAX floats), or a batched kernel's stages of x (gemv_rows)
    xs = gl.allocate_shared_memory(gl.float32, [XR, BK], gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))
    full = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
    pub_full = gl.allocate_shared_memory(gl.int64, [PQ, 1], mbarrier.MBarrierLayout())
    pub_empty = gl.allocate_shared_memory(gl.int64, [PQ, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(NBUF):
        mbarrier.init(full.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
    for s in gl.static_range(PQ):
        mbarrier.init(pub_full.index(s), count=1)
        mbarrier.init(pub_empty.index(s), count=1)
    fence_async_shared()
    gl.warp_specialize([
        (_consumer, (bufs, full, empty, xs, mine, n, steps, arena, ints, kv, emb, counters, err, epoch, cta,
                     trace + first * TRACE_WORDS, peers, BR, BK, NBUF, KMAX, SPIN, TRACE, HD, GP, TILE, KVT, NB, XS,
                     TP, AW, WP, TT, pub_full, pub_empty)),
        (loader, (d0, d1, d2, d3, dkv, bufs, full, empty, mine, n, steps, ints, trace + first * TRACE_WORDS, BR,
                   BK, NBUF, HD, KVT, NB, TRACE, AW, TT)),
        (_publisher, (mine, n, steps, counters, pub_full, pub_empty)),
    ], [LOADER_WARPS, PUBLISHER_WARPS], [LOADER_REGS, LOADER_REGS])
