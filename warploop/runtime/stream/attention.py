"""The attention node kind's body for the streaming kernel (kinds.ATTN), in Gluon.

An ATTN node's cached context is its streamed operand (kinds.StreamedKV): the loader walks the
node's share of the context in ring chunks of KVT tokens, each chunk the keys then the values of
one KV head, as TMA boxes of KVB tokens (one box never crosses a cache block), with no wait on any
dependency. The consumer reads the words, the step's words, the RoPE rows and the q/k norm weights
before its waits; after them it rotates q and the new k, stores the new k and v, and runs an
online softmax over the chunks as they land.

A KV head's q heads, its new k and v and a tile of cached keys share one 3-D layout [GP, TILE, HD]:
scores are products summed over HD, the output products summed over TILE, fp32 throughout; k and v
are rounded to the cache's bf16 once, as stored.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, mma_v2

from warploop.runtime.stream.kinds import ATTN
from warploop.runtime.stream.sync import PUBLIC_REINTERPRET, TRACE_WORDS, barrier, now, tma_load, waits

OP_ATTN = gl.constexpr(ATTN.opcode)
# a ring chunk of keys and values as the loader's TMA wrote it: plain rows (the ring's own layout is
# 128-byte swizzled in a batched kernel, for its weight chunks)
KV_LAYOUT = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2))
KV_LAYOUT3 = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, order=[2, 1, 0]))   # the same plain rows, 3-D
WT = gl.constexpr(16)           # with attn_mma: a warp's tokens a step (an mma's K side in the output products)
A = {f.name: gl.constexpr(ATTN.word(f.name)) for f in ATTN.fields}
A_QKV, A_OUT, A_HEAD, A_KVHEAD, A_GROUP = A["qkv"], A["out"], A["head"], A["kvhead"], A["group"]
A_HEADS, A_KVHEADS, A_STEP, A_COS, A_SIN = A["heads"], A["kvheads"], A["step"], A["cos"], A["sin"]
A_QN, A_KN, A_LAYER, A_BLOCKS, A_BS, A_EPS, A_SCALE = A["qn"], A["kn"], A["layer"], A["blocks"], A["bs"], \
    A["eps"], A["scale"]
A_SPLIT, A_SPLITS, A_PART, A_TICKET = A["split"], A["splits"], A["part"], A["ticket"]
SB = gl.constexpr(16)           # shares a merge takes per round: their loads are issued together


@gluon.jit
def share_tokens(n_ctx, splits, KVT: gl.constexpr):
    """Tokens a share of an n_ctx context holds: whole ring chunks, as evenly as chunks allow."""
    return ((n_ctx + splits - 1) // splits + KVT - 1) // KVT * KVT


@gluon.jit
def share(n_ctx, split, splits, KVT: gl.constexpr):
    """Tokens [lo, hi) of split `split` of `splits`: share_tokens each, the last split what is left."""
    chunk = share_tokens(n_ctx, splits, KVT)
    lo = gl.minimum(split * chunk, n_ctx)
    return lo, gl.minimum(lo + chunk, n_ctx)


@gluon.jit
def live_shares(n_ctx, splits, KVT: gl.constexpr):
    """How many of `splits` shares hold tokens of an n_ctx context."""
    chunk = share_tokens(n_ctx, splits, KVT)
    return gl.minimum(splits, (n_ctx + chunk - 1) // chunk)


@gluon.jit
def stream_kv(dkv, bufs, full, empty, base, ints, it, s, NBUF: gl.constexpr, HD: gl.constexpr, KVT: gl.constexpr):
    """The loader's part of an ATTN node at step s of the launch: its share of the cached context
    into the ring (rows this launch wrote are streamed too, stale: the consumer patches them). A box past
    the share is loaded from row -KVB: out of bounds, so zeros and no traffic, and every chunk
    carries its whole byte count (an mbarrier's expected bytes are a compile-time constant)."""
    KVB: gl.constexpr = dkv.block_type.shape[0]
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
    while t0 < hi:
        tb = t0 + jb * KVB
        ids = gl.load(ints + step + 3 + tb // bs, mask=tb < hi, other=0)
        slot = it % NBUF
        mbarrier.wait(empty.index(slot), ((it // NBUF) & 1) ^ 1)
        bar = full.index(slot)
        mbarrier.expect(bar, 2 * KVT * HD * 2)
        if PUBLIC_REINTERPRET:
            view = bufs.index(slot).reinterpret(gl.bfloat16, [2 * NSUB, KVB, HD], dkv.layout)
        else:
            view = bufs.index(slot)._reinterpret(gl.bfloat16, [2 * NSUB, KVB, HD], dkv.layout)
        for j in gl.static_range(NSUB):
            t = t0 + j * KVB
            ok = t < hi
            r = gl.sum(gl.where(jb == j, ids, 0), axis=0) * bs + t % bs
            tma_load(dkv, [gl.where(ok, krow + r, -KVB), col], bar, view.index(j))
            tma_load(dkv, [gl.where(ok, vrow + r, -KVB), col], bar, view.index(NSUB + j))
        it += 1
        t0 += KVT
    return it


@gluon.jit
def _fresh_rows(ints, step, bs, toks, f0, f1, fresh, row_words, g, HD: gl.constexpr):
    """Element offsets, in a layer's k (or v) cache, of KV head g's rows for tokens `toks`, and
    which of them are in [f0, f1) (none unless `fresh`)."""
    live = fresh & (toks >= f0) & (toks < f1)
    blk = gl.load(ints + step + 3 + toks // bs, mask=live, other=0)
    return (blk.to(gl.int64) * bs + toks % bs) * row_words + g * HD, live


@gluon.jit
def _rope(x, xp, w, wp, cs, sn, eps, NORM, HD: gl.constexpr, d):
    """Heads x ([R, HD]; xp: the same rows with the halves swapped) RMS-normed by w (when NORM; wp
    its halves swapped) and rotated by the RoPE rows cs, sn ([HD], the half-rows repeated): the
    halves convention, x * cos + rot(x) * sin with rot(x) = (-x2, x1)."""
    sign = gl.where(d < HD // 2, -1.0, 1.0)
    if NORM:
        r = gl.rsqrt(gl.sum(x * x, axis=1) / HD + eps)[:, None]
        x = x * r * w[None, :]
        xp = xp * r * wp[None, :]
    return x * cs[None, :] + sign[None, :] * xp * sn[None, :]


@gluon.jit
def attn(arena, ints, kv, base, bufs, full, empty, it, counters, err, epoch, s, failed, cta, i, trace, w0, n0, w1, n1,
         NBUF: gl.constexpr, SPIN: gl.constexpr, TRACE: gl.constexpr, CW: gl.constexpr, HD: gl.constexpr,
         GP: gl.constexpr, TILE: gl.constexpr, KVT: gl.constexpr, AM: gl.constexpr):
    """The ATTN kind's body at step s of the launch, its waits included. Returns the ring's chunk
    count and `failed`. AM (StreamConfig.attn_mma): the chunks' products on tensor cores (_attend_mma)."""
    HALF: gl.constexpr = HD // 2
    # warps split the q heads first, so the softmax's reductions over a tile's tokens and head
    # dims stay inside a warp (shuffles, no shared-memory round trip) when the group fills them
    WG: gl.constexpr = GP if GP < CW else CW
    L3: gl.constexpr = gl.BlockedLayout([1, 1, 8], [1, 32 // (HD // 8), HD // 8], [WG, CW // WG, 1], [2, 1, 0])
    QL: gl.constexpr = gl.SliceLayout(1, L3)          # [GP, HD]: q heads, the output
    KL: gl.constexpr = gl.SliceLayout(0, L3)          # [TILE, HD]: a tile of keys or values
    SL: gl.constexpr = gl.SliceLayout(2, L3)          # [GP, TILE]: scores
    # what no predecessor writes, read before the waits: the words, the step's words, the RoPE rows
    # of the position, the q and k norm weights
    qkv = gl.load(base + A_QKV)
    out = gl.load(base + A_OUT)
    head0 = gl.load(base + A_HEAD)
    g = gl.load(base + A_KVHEAD)
    grp = gl.load(base + A_GROUP)
    heads = gl.load(base + A_HEADS)
    kvh = gl.load(base + A_KVHEADS)
    step = gl.load(base + A_STEP)
    cos_t = gl.load(base + A_COS)
    sin_t = gl.load(base + A_SIN)
    qn = gl.load(base + A_QN)
    kn = gl.load(base + A_KN)
    layer = gl.load(base + A_LAYER)
    blocks = gl.load(base + A_BLOCKS)
    bs = gl.load(base + A_BS)
    eps = gl.load(base + A_EPS).to(gl.float32, bitcast=True)
    scale = gl.load(base + A_SCALE).to(gl.float32, bitcast=True)
    split = gl.load(base + A_SPLIT)
    splits = gl.load(base + A_SPLITS)
    part = gl.load(base + A_PART)
    ticket = gl.load(base + A_TICKET)
    pos0 = gl.load(ints + step)                 # the launch's first position: rows from it on are this launch's
    pos = pos0 + s
    n_ctx = gl.load(ints + step + 1) + s
    write = gl.load(ints + step + 2)
    slot = gl.load(ints + step + 3 + pos // bs) * bs + pos % bs
    lo, hi = share(n_ctx, split, splits, KVT)
    row_words = (kvh * HD).to(gl.int64)
    kc = kv + layer.to(gl.int64) * 2 * blocks * bs * row_words
    vc = kc + blocks.to(gl.int64) * bs * row_words
    dq = gl.arange(0, HD, layout=gl.SliceLayout(0, QL))
    dqp = gl.where(dq < HALF, dq + HALF, dq - HALF)
    jq = gl.minimum(gl.arange(0, GP, layout=gl.SliceLayout(1, QL)), grp - 1)   # padded rows repeat the last head
    csq = gl.load(arena + cos_t + pos * HALF + dq % HALF)
    snq = gl.load(arena + sin_t + pos * HALF + dq % HALF)
    wq = gl.load(arena + qn + dq, mask=qn >= 0, other=0.0)
    wqp = gl.load(arena + qn + dqp, mask=qn >= 0, other=0.0)
    dk = gl.arange(0, HD, layout=gl.SliceLayout(0, KL))
    dkp = gl.where(dk < HALF, dk + HALF, dk - HALF)
    one = gl.arange(0, 1, layout=gl.SliceLayout(1, KL))
    csk = gl.load(arena + cos_t + pos * HALF + dk % HALF)
    snk = gl.load(arena + sin_t + pos * HALF + dk % HALF)
    wk = gl.load(arena + kn + dk, mask=kn >= 0, other=0.0)
    wkp = gl.load(arena + kn + dkp, mask=kn >= 0, other=0.0)
    # rows [f0, f1) of the share were written by earlier steps of this launch (plain stores another
    # SM made, ordered before this node by the chain of waits): the ring may hold what TMA read
    # before them, so the chunks holding them are patched from L2. Their cache rows are found here,
    # before the waits (the block table is the host's), for the first and the last such chunk
    FL: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (HD // 8), HD // 8], [CW, 1], [1, 0])
    f0 = gl.maximum(lo, pos0)
    f1 = gl.minimum(hi, pos)
    fresh = (s > 0) & (f0 < f1)
    ca = lo + (f0 - lo) // KVT * KVT
    cb = lo + (f1 - 1 - lo) // KVT * KVT
    rf = gl.arange(0, KVT, layout=gl.SliceLayout(1, FL))
    df = gl.arange(0, HD, layout=gl.SliceLayout(0, FL))
    row_a, in_a = _fresh_rows(ints, step, bs, ca + rf, f0, f1, fresh, row_words, g, HD)
    row_b, in_b = _fresh_rows(ints, step, bs, cb + rf, f0, f1, fresh, row_words, g, HD)
    # a share past the context (a program of more shares than the context fills) only waits and
    # signals: it loads, stores and merges nothing, and takes no ticket
    busy = lo < hi
    failed = waits(counters, err, w0, n0, w1, n1, epoch, failed, cta, i, trace, SPIN, TRACE)
    # q heads of the group in the scores' row layout; the new k and v as row 0 of a [1, HD] tile.
    # .cg: a predecessor on another SM wrote them, so L2, never a stale L1 line (with AM, q's rows
    # padded to an mma's 16, in _attend_mma's layout)
    if AM:
        q = _q_rows(arena, qkv, head0, grp, busy, csq, snq, wq, wqp, eps, qn, CW, HD)
    else:
        src = qkv + (head0 + jq) * HD
        q = _rope(gl.load(arena + src[:, None] + dq[None, :], mask=busy, other=0.0, cache_modifier=".cg"),
                  gl.load(arena + src[:, None] + dqp[None, :], mask=busy, other=0.0, cache_modifier=".cg"), wq, wqp,
                  csq, snq, eps, qn >= 0, HD, dq)
    ksrc = qkv + (heads + g) * HD + one
    knew = _rope(gl.load(arena + ksrc[:, None] + dk[None, :], mask=busy, other=0.0, cache_modifier=".cg"),
                 gl.load(arena + ksrc[:, None] + dkp[None, :], mask=busy, other=0.0, cache_modifier=".cg"), wk, wkp,
                 csk, snk, eps, kn >= 0, HD, dk).to(gl.bfloat16)
    vnew = gl.load(arena + qkv + (heads + kvh + g) * HD + one[:, None] + dk[None, :], mask=busy, other=0.0,
                   cache_modifier=".cg").to(gl.bfloat16)
    if (write >= 0) & (lo <= n_ctx - 1) & (n_ctx - 1 < hi):     # the share holding the new token
        dst = slot.to(gl.int64) * row_words + g * HD + one[:, None] + dk[None, :]
        gl.store(kc + dst, knew)
        gl.store(vc + dst, vnew)
    if AM:
        it = _attend_mma(arena, bufs, full, empty, it, counters, trace, i, q, out, head0, grp, scale, split,
                         splits, part, ticket, n_ctx, lo, hi, busy, fresh, f0, f1, ca, cb,
                         row_a, in_a, row_b, in_b, ints, step, bs, row_words, g, kc, vc, knew, vnew, NBUF, TRACE,
                         CW, HD, GP, KVT)
    else:
        knew = knew.to(gl.float32)
        vnew = vnew.to(gl.float32)
        tk = gl.arange(0, TILE, layout=gl.SliceLayout(1, KL))
        ts = gl.arange(0, TILE, layout=gl.SliceLayout(0, SL))
        m_i = gl.full([GP], float("-inf"), gl.float32, layout=gl.SliceLayout(1, SL))
        l_i = gl.zeros([GP], gl.float32, layout=gl.SliceLayout(1, SL))
        acc = gl.zeros([GP, HD], gl.float32, layout=QL)
        t0 = lo
        while t0 < hi:                  # a ring chunk: KVT keys, then their KVT values
            b = it % NBUF               # the ring slot (s is the step)
            mbarrier.wait(full.index(b), (it // NBUF) & 1)
            if TRACE:
                if t0 == lo:
                    gl.store(trace + i * TRACE_WORDS + 2, now())
            if PUBLIC_REINTERPRET:
                chunk = bufs.index(b).reinterpret(gl.bfloat16, [2 * KVT, HD], KV_LAYOUT)
            else:
                chunk = bufs.index(b)._reinterpret(gl.bfloat16, [2 * KVT, HD], KV_LAYOUT)
            if fresh & (t0 < f1) & (t0 + KVT > f0):
                # one round trip for the chunk's rows of this launch, written over the ring's copy
                if t0 == ca:
                    rows_f, in_f = row_a, in_a
                elif t0 == cb:
                    rows_f, in_f = row_b, in_b
                else:                   # a chunk between the first and the last (more steps than a chunk)
                    rows_f, in_f = _fresh_rows(ints, step, bs, t0 + rf, f0, f1, fresh, row_words, g, HD)
                m2 = in_f[:, None]
                at = rows_f[:, None] + df[None, :]
                k_f = gl.load(kc + at, mask=m2, other=0.0, cache_modifier=".cg")
                v_f = gl.load(vc + at, mask=m2, other=0.0, cache_modifier=".cg")
                k_r = chunk.slice(0, KVT).load(FL)
                v_r = chunk.slice(KVT, KVT).load(FL)
                chunk.slice(0, KVT).store(gl.where(m2, k_f, k_r))
                chunk.slice(KVT, KVT).store(gl.where(m2, v_f, v_r))
                barrier()               # the patched rows before any warp reads them
            for sub in gl.static_range(KVT // TILE):
                toks = t0 + sub * TILE + tk
                live = (toks < hi)[:, None]
                new = (toks == n_ctx - 1)[:, None]
                # rows past the share are zeros or another share's: masked, so a NaN there cannot leak
                kt = gl.where(new, knew,
                              gl.where(live, chunk.slice(sub * TILE, TILE).load(KL).to(gl.float32), 0.0))
                vt = gl.where(new, vnew,
                              gl.where(live, chunk.slice(KVT + sub * TILE, TILE).load(KL).to(gl.float32), 0.0))
                sc = gl.sum(q[:, None, :] * kt[None, :, :], axis=2) * scale
                sc = gl.where((t0 + sub * TILE + ts < hi)[None, :], sc, float("-inf"))
                m_new = gl.maximum(m_i, gl.max(sc, axis=1))
                p = gl.exp(sc - m_new[:, None])
                alpha = gl.exp(m_i - m_new)
                l_i = l_i * alpha + gl.sum(p, axis=1)
                a_q = gl.convert_layout(alpha, gl.SliceLayout(1, QL))
                acc = acc * a_q[:, None] + gl.sum(p[:, :, None] * vt[None, :, :], axis=1)
                m_i = m_new
            barrier()                   # every warp is done with the slot before one thread frees it
            fence_async_shared()
            mbarrier.arrive(empty.index(b))
            it += 1
            t0 += KVT
        jo = gl.arange(0, GP, layout=gl.SliceLayout(1, QL))
        if splits == 1:
            o = acc / gl.convert_layout(l_i, gl.SliceLayout(1, QL))[:, None]
            gl.store(arena + out + (head0 + jo)[:, None] * HD + dq[None, :], o, mask=(jo < grp)[:, None])
        elif busy:
            pb = arena + part + split * grp * (HD + 2)
            gl.store(pb + jo[:, None] * HD + dq[None, :], acc, mask=(jo < grp)[:, None])
            js = gl.arange(0, GP, layout=gl.SliceLayout(1, SL))
            gl.store(pb + grp * HD + js, m_i, mask=js < grp)
            gl.store(pb + grp * HD + grp + js, l_i, mask=js < grp)
            _ticket(arena, counters, ticket, part, out, head0, grp, n_ctx, splits, CW, HD, GP, KVT)
    return it, failed


@gluon.jit
def _ticket(arena, counters, ticket, part, out, head0, grp, n_ctx, splits, CW: gl.constexpr, HD: gl.constexpr,
            GP: gl.constexpr, KVT: gl.constexpr):
    """After a share stored its partials: take the KV head's ticket (if it has one), and merge if
    it is the last. The share that takes the head's last ticket merges the shares the context
    fills: the acq_rel add publishes these partials to it, and orders the other shares' before its
    reads. It sets the ticket back to 0 for the next run; its signal (a release after this) orders
    that before any share of the next run takes one."""
    if ticket >= 0:
        barrier()
        taken = gl.atomic_add(counters + ticket, 1, sem="acq_rel", scope="gpu")
        live = live_shares(n_ctx, splits, KVT)
        if taken + 1 == live:
            merge(arena, part, out, head0, grp, live, CW, HD, GP)
            gl.atomic_xchg(counters + ticket, 0, sem="relaxed", scope="gpu")


@gluon.jit
def _q_rows(arena, qkv, head0, grp, busy, csq, snq, wq, wqp, eps, qn, CW: gl.constexpr, HD: gl.constexpr):
    """The group's q heads normed and rotated as attn's, padded to an mma's 16 rows (the padding
    repeats the last head), in the layout _attend_mma makes every warp's copy from."""
    HALF: gl.constexpr = HD // 2
    QM: gl.constexpr = gl.SliceLayout(0, gl.BlockedLayout([1, 1, 8], [1, 32 // (HD // 8), HD // 8], [CW, 1, 1],
                                                          [2, 1, 0]))
    dq = gl.arange(0, HD, layout=gl.SliceLayout(0, QM))
    dqp = gl.where(dq < HALF, dq + HALF, dq - HALF)
    jq = gl.minimum(gl.arange(0, 16, layout=gl.SliceLayout(1, QM)), grp - 1)
    src = qkv + (head0 + jq) * HD
    return _rope(gl.load(arena + src[:, None] + dq[None, :], mask=busy, other=0.0, cache_modifier=".cg"),
                 gl.load(arena + src[:, None] + dqp[None, :], mask=busy, other=0.0, cache_modifier=".cg"),
                 gl.convert_layout(wq, gl.SliceLayout(0, QM)), gl.convert_layout(wqp, gl.SliceLayout(0, QM)),
                 gl.convert_layout(csq, gl.SliceLayout(0, QM)), gl.convert_layout(snq, gl.SliceLayout(0, QM)),
                 eps, qn >= 0, HD, dq)


@gluon.jit
def _attend_mma(arena, bufs, full, empty, it, counters, trace, i, q, out, head0, grp, scale, split, splits, part,
                ticket, n_ctx, lo, hi, busy, fresh, f0, f1, ca, cb, row_a, in_a, row_b,
                in_b, ints, step, bs, row_words, g, kc, vc, knew, vnew, NBUF: gl.constexpr, TRACE: gl.constexpr,
                CW: gl.constexpr, HD: gl.constexpr, GP: gl.constexpr, KVT: gl.constexpr):
    """attn's chunks with their products on tensor cores (StreamConfig.attn_mma), after its waits,
    the new k and v stored: returns the ring's chunk count.

    The group's q heads (rounded to bf16, padded to an mma's 16 rows) against each token warp's own
    WT tokens a step (TW token warps, a chunk KVT // (WT * TW) steps; with fewer than CW token warps,
    a chunk of under 64 tokens, the others split the mmas' N side): scores by one mma over HD, fp32;
    each token warp keeps its own running max, sum and output over its tokens; the probabilities
    enter the output mma as bf16, their sum stays fp32. The token warps' states merge once, after
    the share's last chunk. The ring slot is read as the mmas' operands,
    so the rows this launch wrote (earlier steps' and the new token's) are patched into it first."""
    TW: gl.constexpr = KVT // WT if KVT // WT < CW else CW   # warps on tokens; the rest split the N side
    NST: gl.constexpr = KVT // (WT * TW)
    MB: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[TW, 1, CW // TW],
                                                 instr_shape=[1, 16, 8])
    QA: gl.constexpr = gl.DotOperandLayout(0, MB, 2)       # [TW, 16, HD]: q, every warp the same
    KB: gl.constexpr = gl.DotOperandLayout(1, MB, 2)       # [TW, HD, WT]: a warp's keys, transposed
    PA: gl.constexpr = gl.DotOperandLayout(0, MB, 2)       # [TW, 16, WT]: a warp's probabilities
    VB: gl.constexpr = gl.DotOperandLayout(1, MB, 2)       # [TW, WT, HD]: a warp's values
    L3M: gl.constexpr = gl.BlockedLayout([1, 1, 8], [1, 32 // (HD // 8), HD // 8], [CW, 1, 1], [2, 1, 0])
    FL: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (HD // 8), HD // 8], [CW, 1], [1, 0])
    q3 = q[None, :, :] + gl.zeros([TW, 16, HD], gl.float32, layout=L3M)
    qa = gl.convert_layout(q3.to(gl.bfloat16), QA)
    # each element's token, less the step's first: warp w holds tokens w * WT + [0, WT)
    wv = gl.arange(0, TW, layout=gl.SliceLayout(1, gl.SliceLayout(2, MB)))[:, None, None]
    jv = gl.arange(0, WT, layout=gl.SliceLayout(0, gl.SliceLayout(1, MB)))[None, None, :]
    tok_s = wv * WT + jv                                    # [TW, 1, WT]: the scores' columns
    wb = gl.arange(0, TW, layout=gl.SliceLayout(1, gl.SliceLayout(2, VB)))[:, None, None]
    jb = gl.arange(0, WT, layout=gl.SliceLayout(0, gl.SliceLayout(2, VB)))[None, :, None]
    tok_v = wb * WT + jb                                    # [TW, WT, 1]: the values' rows
    rf = gl.arange(0, KVT, layout=gl.SliceLayout(1, FL))
    df = gl.arange(0, HD, layout=gl.SliceLayout(0, FL))
    k_new = gl.convert_layout(knew, FL)                     # [1, HD], bf16 as stored
    v_new = gl.convert_layout(vnew, FL)
    m_i = gl.full([TW, 16], float("-inf"), gl.float32, layout=gl.SliceLayout(2, MB))
    l_i = gl.zeros([TW, 16], gl.float32, layout=gl.SliceLayout(2, MB))
    acc = gl.zeros([TW, 16, HD], gl.float32, layout=MB)
    last = n_ctx - 1
    t0 = lo
    while t0 < hi:                    # a ring chunk: KVT keys, then their KVT values
        b = it % NBUF
        mbarrier.wait(full.index(b), (it // NBUF) & 1)
        if TRACE:
            if t0 == lo:
                gl.store(trace + i * TRACE_WORDS + 2, now())
        if PUBLIC_REINTERPRET:
            chunk = bufs.index(b).reinterpret(gl.bfloat16, [2 * KVT, HD], KV_LAYOUT)
            kv3 = bufs.index(b).reinterpret(gl.bfloat16, [2 * KVT // WT, WT, HD], KV_LAYOUT3)
        else:
            chunk = bufs.index(b)._reinterpret(gl.bfloat16, [2 * KVT, HD], KV_LAYOUT)
            kv3 = bufs.index(b)._reinterpret(gl.bfloat16, [2 * KVT // WT, WT, HD], KV_LAYOUT3)
        stale = fresh & (t0 < f1) & (t0 + KVT > f0)
        if stale | ((t0 <= last) & (last < t0 + KVT)):
            # the chunk's rows of this launch (one round trip) and the new token's, over the ring's copy
            if t0 == ca:
                rows_f, in_f = row_a, in_a
            elif t0 == cb:
                rows_f, in_f = row_b, in_b
            else:
                rows_f, in_f = _fresh_rows(ints, step, bs, t0 + rf, f0, f1, fresh, row_words, g, HD)
            m2 = (in_f & stale)[:, None]
            at = rows_f[:, None] + df[None, :]
            k_f = gl.load(kc + at, mask=m2, other=0.0, cache_modifier=".cg")
            v_f = gl.load(vc + at, mask=m2, other=0.0, cache_modifier=".cg")
            is_new = (t0 + rf == last)[:, None]
            k_r = chunk.slice(0, KVT).load(FL)
            v_r = chunk.slice(KVT, KVT).load(FL)
            chunk.slice(0, KVT).store(gl.where(is_new, k_new, gl.where(m2, k_f, k_r)))
            chunk.slice(KVT, KVT).store(gl.where(is_new, v_new, gl.where(m2, v_f, v_r)))
            barrier()                 # the patched rows before any warp reads them
        for st in gl.static_range(NST):
            base = t0 + st * (WT * TW)
            kt = kv3.slice(st * TW, TW).permute((0, 2, 1)).load(KB)                 # [TW, HD, WT]
            sc = mma_v2(qa, kt, gl.zeros([TW, 16, WT], gl.float32, layout=MB)) * scale
            # tokens past the share are zeros or another share's: masked, so a NaN cannot leak
            sc = gl.where(base + tok_s < hi, sc, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(sc, axis=2))
            m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)  # a warp with no token yet
            p = gl.exp(sc - m_safe[:, :, None])
            alpha = gl.exp(m_i - m_safe)
            l_i = l_i * alpha + gl.sum(p, axis=2)
            vt = kv3.slice(KVT // WT + st * TW, TW).load(VB)                          # [TW, WT, HD]
            vt = gl.where(base + tok_v < hi, vt, 0.0)
            acc = mma_v2(gl.convert_layout(p.to(gl.bfloat16), PA), vt, acc * alpha[:, :, None])
            m_i = m_new
        barrier()                     # every warp is done with the slot before one thread frees it
        fence_async_shared()
        mbarrier.arrive(empty.index(b))
        it += 1
        t0 += KVT
    # the warps' states into the share's: M the largest running max, each warp's sums scaled to it
    big = gl.max(m_i, axis=0)
    w = gl.exp(m_i - gl.where(big == float("-inf"), 0.0, big)[None, :])
    den = gl.sum(l_i * w, axis=0)                                                   # [16]
    num = gl.sum(acc * w[:, :, None], axis=0)                                       # [16, HD]
    jo = gl.arange(0, 16, layout=gl.SliceLayout(1, gl.SliceLayout(0, MB)))
    do = gl.arange(0, HD, layout=gl.SliceLayout(0, gl.SliceLayout(0, MB)))
    if splits == 1:
        o = num / gl.convert_layout(den, gl.SliceLayout(1, gl.SliceLayout(0, MB)))[:, None]
        gl.store(arena + out + (head0 + jo)[:, None] * HD + do[None, :], o, mask=(jo < grp)[:, None])
    elif busy:
        pb = arena + part + split * grp * (HD + 2)
        gl.store(pb + jo[:, None] * HD + do[None, :], num, mask=(jo < grp)[:, None])
        js = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, MB)))
        gl.store(pb + grp * HD + js, big, mask=js < grp)
        gl.store(pb + grp * HD + grp + js, den, mask=js < grp)
        _ticket(arena, counters, ticket, part, out, head0, grp, n_ctx, splits, CW, HD, GP, KVT)
    return it


@gluon.jit
def merge(arena, part, out, head0, grp, splits, CW: gl.constexpr, HD: gl.constexpr, GP: gl.constexpr):
    """A KV head's shares' partials at `part` into its q heads' rows of out:
    out = sum_s acc_s e^(m_s - M) / sum_s l_s e^(m_s - M), M = max_s m_s,
    SB splits a round (one round trip for all their partials), the running M rescaling the sums.
    Lanes hold the splits and warps the q heads, so the sums over splits stay inside a warp."""
    WG: gl.constexpr = GP if GP < CW else CW
    L3: gl.constexpr = gl.BlockedLayout([SB // (32 // (HD // 8)), 1, 8], [32 // (HD // 8), 1, HD // 8],
                                        [CW // WG, WG, 1], [2, 1, 0])
    ML: gl.constexpr = gl.SliceLayout(2, L3)          # [SB, GP]: running max and sum per split and head
    OL: gl.constexpr = gl.SliceLayout(0, L3)          # [GP, HD]: the output
    stride = grp * (HD + 2)
    s1 = gl.arange(0, SB, layout=gl.SliceLayout(1, ML))
    jm = gl.minimum(gl.arange(0, GP, layout=gl.SliceLayout(0, ML)), grp - 1)   # padded rows repeat the last head
    d = gl.arange(0, HD, layout=gl.SliceLayout(0, OL))
    d3 = gl.arange(0, HD, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3)))[None, None, :]
    big = gl.full([GP], float("-inf"), gl.float32, layout=gl.SliceLayout(0, ML))
    den = gl.zeros([GP], gl.float32, layout=gl.SliceLayout(0, ML))
    num = gl.zeros([GP, HD], gl.float32, layout=OL)
    s0 = 0
    while s0 < splits:
        sp = s0 + s1
        ok = (sp < splits)[:, None]
        at = part + sp[:, None] * stride + grp * HD + jm[None, :]            # [SB, GP]
        m = gl.load(arena + at, mask=ok, other=float("-inf"), cache_modifier=".cg")
        ls = gl.load(arena + at + grp, mask=ok, other=0.0, cache_modifier=".cg")
        rows = part + sp[:, None] * stride + jm[None, :] * HD               # [SB, GP]
        acc = gl.load(arena + rows[:, :, None] + d3, mask=ok[:, :, None], other=0.0,
                      cache_modifier=".cg")
        big_new = gl.maximum(big, gl.max(m, axis=0))   # finite: split 0 always holds a token
        r = gl.exp(big - big_new)
        w = gl.exp(m - big_new[None, :])
        den = den * r + gl.sum(w * ls, axis=0)
        r_o = gl.convert_layout(r, gl.SliceLayout(1, OL))
        num = num * r_o[:, None] + gl.sum(w[:, :, None] * acc, axis=0)
        big = big_new
        s0 += SB
    j = gl.arange(0, GP, layout=gl.SliceLayout(1, OL))
    o = num / gl.convert_layout(den, gl.SliceLayout(1, OL))[:, None]
    gl.store(arena + out + (head0 + j)[:, None] * HD + d[None, :], o, mask=(j < grp)[:, None])
