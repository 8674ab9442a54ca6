"""The attention node kind's body for the streaming kernel (kinds.ATTN), in Gluon.

An ATTN node's cached context is its streamed operand (kinds.StreamedKV): the loader
(loader.stream_kv) walks the node's share of the context in ring chunks of KVT tokens, each chunk
the keys then the values of one KV head, as TMA boxes of KVB tokens (one box never crosses a cache
block), with no wait on any dependency. The consumer reads the words, the step's words, the RoPE
rows and the q/k norm weights before its waits; after them it rotates q and the new k, stores the
new k and v, and runs an online softmax over the chunks as they land.

A KV head's q heads, its new k and v and a tile of cached keys share one 3-D layout [GP, TILE, HD]:
scores are products summed over HD, the output products summed over TILE, fp32 throughout; k and v
are rounded to the cache's bf16 once, as stored. With AW (StreamConfig.attn_wgmma) a chunk is two
wgmma products instead, q and the probabilities as bf16 operands (attn's docstring). The shares
and their merge are shares.py's; the rows they read, kv_rows.py's.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from warploop.runtime.stream.kinds import ATTN
from warploop.runtime.stream.kv_rows import KV_LAYOUT, fresh_rows, patch_rows, patch_slot, rope
from warploop.runtime.stream.shares import share, store_out, take_ticket
from warploop.runtime.stream.sync import TRACE_WORDS, barrier, now, waits

OP_ATTN = gl.constexpr(ATTN.opcode)
A = {f.name: gl.constexpr(ATTN.word(f.name)) for f in ATTN.fields}
A_QKV, A_OUT, A_HEAD, A_KVHEAD, A_GROUP = A["qkv"], A["out"], A["head"], A["kvhead"], A["group"]
A_HEADS, A_KVHEADS, A_STEP, A_COS, A_SIN = A["heads"], A["kvheads"], A["step"], A["cos"], A["sin"]
A_QN, A_KN, A_LAYER, A_BLOCKS, A_BS, A_EPS, A_SCALE = A["qn"], A["kn"], A["layer"], A["blocks"], A["bs"], \
    A["eps"], A["scale"]
A_SPLIT, A_SPLITS, A_PART, A_TICKET, A_OBF = A["split"], A["splits"], A["part"], A["ticket"], A["obf"]


@gluon.jit
def attn(arena, ints, kv, base, bufs, full, empty, xs, it, counters, err, epoch, s, failed, cta, i, trace, w0, n0, w1,
         n1, NBUF: gl.constexpr, SPIN: gl.constexpr, TRACE: gl.constexpr, CW: gl.constexpr, HD: gl.constexpr,
         GP: gl.constexpr, TILE: gl.constexpr, KVT: gl.constexpr, XB: gl.constexpr, AW: gl.constexpr):
    """The ATTN kind's body at step s of the launch, its waits included (XB, a batched kernel: out
    may hold bf16 rows, kinds.ATTN obf). AW (StreamConfig.attn_wgmma): a chunk's products on wgmma,
    the chunk's 128-byte swizzled keys and values read from the slot as they lie, q and the
    probabilities as bf16 through x's shared memory (xs). Returns the ring's chunk count and `failed`."""
    HALF: gl.constexpr = HD // 2
    # warps split the q heads first, so the softmax's reductions over a tile's tokens and head
    # dims stay inside a warp (shuffles, no shared-memory round trip) when the group fills them
    WG: gl.constexpr = GP if GP < CW else CW
    L3: gl.constexpr = gl.BlockedLayout([1, 1, 8], [1, 32 // (HD // 8), HD // 8], [WG, CW // WG, 1], [2, 1, 0])
    QL: gl.constexpr = gl.SliceLayout(1, L3)          # [GP, HD]: q heads, the output
    KL: gl.constexpr = gl.SliceLayout(0, L3)          # [TILE, HD]: a tile of keys or values
    SL: gl.constexpr = gl.SliceLayout(2, L3)          # [GP, TILE]: scores
    KW: gl.constexpr = 64 if AW else HD               # the slot's rows: a head's, or 64-column blocks of it
    NHB: gl.constexpr = HD // KW                      # a head's 64-column blocks (2 at head_dim 128)
    # kv_split (StreamConfig.kv_split): a chunk's keys fill a slot and its values the next
    KS: gl.constexpr = AW and KVT * HD == bufs.shape[1] * bufs.shape[2]
    if AW:                          # scores and outputs transposed, [KVT, GP] and [HD, GP]: the q heads are wgmma's N
        SACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[CW, 1], instr_shape=[16, GP, 16])
        KVS: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        PLAIN: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])
        XW: gl.constexpr = xs.shape[1]                    # x's rows: BK floats
        QR: gl.constexpr = GP * HD // (2 * XW)            # q's bf16 [GP, HD] in x's rows, the probabilities after
        PR: gl.constexpr = GP * KVT // (2 * XW)
        OR: gl.constexpr = GP * HD // XW                  # the outputs' fp32 [GP, HD], once the chunks are done
        if KS:                      # q as [NHB, GP, KW] blocks; q, the new k and v staged fp32 first (a slice's
            # offset a multiple of its rows)
            q_s = xs.slice(0, QR).reinterpret(gl.bfloat16, [NHB, GP, KW], KVS)
            f_s = xs.slice(OR, OR).reinterpret(gl.float32, [GP, HD], PLAIN)
            n_s = xs.slice(2 * OR, max(1, 2 * HD // XW)).reinterpret(gl.float32, [2, HD], PLAIN)
        else:
            q_s = xs.slice(0, QR).reinterpret(gl.bfloat16, [GP, HD], KVS)
        PO: gl.constexpr = (QR + PR - 1) // PR * PR       # after q, at a multiple of its rows
        p_s = xs.slice(PO, PR).reinterpret(gl.bfloat16, [GP, KVT], KVS)
        o_s = xs.slice(0, OR).reinterpret(gl.float32, [GP, HD], PLAIN)
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
    FL: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (KW // 8), KW // 8], [CW, 1], [1, 0])
    f0 = gl.maximum(lo, pos0)
    f1 = gl.minimum(hi, pos)
    fresh = (s > 0) & (f0 < f1)
    ca = lo + (f0 - lo) // KVT * KVT
    cb = lo + (f1 - 1 - lo) // KVT * KVT
    rf = gl.arange(0, KVT, layout=gl.SliceLayout(1, FL))
    df = gl.arange(0, KW, layout=gl.SliceLayout(0, FL))
    row_a, in_a = fresh_rows(ints, step, bs, ca + rf, f0, f1, fresh, row_words, g, HD)
    row_b, in_b = fresh_rows(ints, step, bs, cb + rf, f0, f1, fresh, row_words, g, HD)
    # a share past the context (a program of more shares than the context fills) only waits and
    # signals: it loads, stores and merges nothing, and takes no ticket
    busy = lo < hi
    failed = waits(counters, err, w0, n0, w1, n1, epoch, failed, cta, i, trace, SPIN, TRACE)
    # q heads of the group in the scores' row layout; the new k and v as row 0 of a [1, HD] tile.
    # .cg: a predecessor on another SM wrote them, so L2, never a stale L1 line
    src = qkv + (head0 + jq) * HD
    q = rope(gl.load(arena + src[:, None] + dq[None, :], mask=busy, other=0.0, cache_modifier=".cg"),
             gl.load(arena + src[:, None] + dqp[None, :], mask=busy, other=0.0, cache_modifier=".cg"), wq, wqp,
             csq, snq, eps, qn >= 0, HD, dq)
    ksrc = qkv + (heads + g) * HD + one
    knew = rope(gl.load(arena + ksrc[:, None] + dk[None, :], mask=busy, other=0.0, cache_modifier=".cg"),
                 gl.load(arena + ksrc[:, None] + dkp[None, :], mask=busy, other=0.0, cache_modifier=".cg"), wk, wkp,
                 csk, snk, eps, kn >= 0, HD, dk).to(gl.bfloat16)
    vnew = gl.load(arena + qkv + (heads + kvh + g) * HD + one[:, None] + dk[None, :], mask=busy, other=0.0,
                   cache_modifier=".cg").to(gl.bfloat16)
    if (write >= 0) & (lo <= n_ctx - 1) & (n_ctx - 1 < hi):     # the share holding the new token
        dst = slot.to(gl.int64) * row_words + g * HD + one[:, None] + dk[None, :]
        gl.store(kc + dst, knew)
        gl.store(vc + dst, vnew)
    if AW:
        if KS:                      # q into its column blocks, the new k and v kept for the slots' patches
            f_s.store(q)
            n_s.slice(0, 1).store(knew.to(gl.float32))
            n_s.slice(1, 1).store(vnew.to(gl.float32))
            barrier()
            for c in gl.static_range(NHB):
                q_s.index(c).store(f_s.slice(c * KW, KW, dim=1).load(FL).to(gl.bfloat16))
            ot2 = gl.zeros([KW, GP], gl.float32, layout=SACC)
        else:
            q_s.store(q.to(gl.bfloat16))
            knew_f = gl.convert_layout(knew, FL)
            vnew_f = gl.convert_layout(vnew, FL)
        fence_async_shared()        # q written through the generic proxy, read by wgmma through the async one
        tok = gl.arange(0, KVT, layout=gl.SliceLayout(1, SACC))
        m_i = gl.full([GP], float("-inf"), gl.float32, layout=gl.SliceLayout(0, SACC))
        lp = gl.zeros([KVT, GP], gl.float32, layout=SACC)     # each thread's part of the sums, added once
        ot = gl.zeros([KW, GP], gl.float32, layout=SACC)
        s0 = gl.zeros([KVT, GP], gl.float32, layout=SACC)
    else:
        knew = knew.to(gl.float32)
        vnew = vnew.to(gl.float32)
        tk = gl.arange(0, TILE, layout=gl.SliceLayout(1, KL))
        ts = gl.arange(0, TILE, layout=gl.SliceLayout(0, SL))
        m_i = gl.full([GP], float("-inf"), gl.float32, layout=gl.SliceLayout(1, SL))
        l_i = gl.zeros([GP], gl.float32, layout=gl.SliceLayout(1, SL))
        acc = gl.zeros([GP, HD], gl.float32, layout=QL)
    t0 = lo
    if TRACE:
        dwait = (lo * 0).to(gl.int64)
    while t0 < hi:                  # a ring chunk: KVT keys, then their KVT values
        b = it % NBUF               # the ring slot (s is the step)
        if TRACE:
            tw = now()
        mbarrier.wait(full.index(b), (it // NBUF) & 1)
        if TRACE:
            if t0 == lo:
                gl.store(trace + i * TRACE_WORDS + 2, now())
            else:
                dwait += now() - tw
        stale = fresh & (t0 < f1) & (t0 + KVT > f0)
        if KS:                      # kv_split: this slot holds the chunk's keys, the next its values
            tail = t0 + KVT > hi
            newin = (t0 <= n_ctx - 1) & (n_ctx - 1 < t0 + KVT)
            new = (t0 + rf == n_ctx - 1)[:, None]
            kv3 = bufs.index(b).reinterpret(gl.bfloat16, [NHB, KVT, KW], KVS)
            patch_slot(kv3, kc, n_s.slice(0, 1), stale, newin, new, hi, t0, ca, cb, row_a, in_a, row_b, in_b, ints,
                       step, bs, f0, f1, fresh, row_words, g, rf, df, FL, HD, NHB, KW, False)
            fence_async_shared()
            barrier()
            # scores^T [KVT, GP]: the keys' column blocks [KVT, KW] (M) by q's [KW, GP] (N), summed
            sc = warpgroup_mma(kv3.index(0), q_s.index(0).permute((1, 0)), s0, use_acc=False, is_async=True)
            for c in gl.static_range(1, NHB):
                sc = warpgroup_mma(kv3.index(c), q_s.index(c).permute((1, 0)), sc, is_async=True)
            sc = warpgroup_mma_wait(num_outstanding=0, deps=(sc,)) * scale
            barrier()               # every warp's products are done before the keys' slot is freed
            mbarrier.arrive(empty.index(b))
            it += 1
            b = it % NBUF
            if TRACE:
                tw = now()
            mbarrier.wait(full.index(b), (it // NBUF) & 1)
            if TRACE:
                dwait += now() - tw
            kv3 = bufs.index(b).reinterpret(gl.bfloat16, [NHB, KVT, KW], KVS)
            # the values: zeros past the share too (a zero probability times NaN is NaN in the product)
            patch_slot(kv3, vc, n_s.slice(1, 1), stale, newin | tail, new, hi, t0, ca, cb, row_a, in_a, row_b, in_b,
                       ints, step, bs, f0, f1, fresh, row_words, g, rf, df, FL, HD, NHB, KW, True)
            fence_async_shared()
            barrier()
        else:
            if AW:
                chunk = bufs.index(b).reinterpret(gl.bfloat16, [2 * KVT, HD], KVS)
            else:
                chunk = bufs.index(b).reinterpret(gl.bfloat16, [2 * KVT, HD], KV_LAYOUT)
            if stale:
                patch_rows(chunk, t0, ca, cb, row_a, in_a, row_b, in_b, ints, step, bs, f0, f1, fresh,
                           row_words, g, kc, vc, rf, df, FL, HD, KVT)
                if not AW:
                    barrier()       # the patched rows before any warp reads them
        if AW & (not KS):
            tail = t0 + KVT > hi
            if (t0 <= n_ctx - 1) & (n_ctx - 1 < t0 + KVT) | tail:
                # the new token's k and v over the slot's stale row, and zeros for values past the share
                # (unwritten rows may hold NaN, and a zero probability times NaN is NaN in the product)
                kt = chunk.slice(0, KVT).load(FL)
                vt = chunk.slice(KVT, KVT).load(FL)
                new = (t0 + rf == n_ctx - 1)[:, None]
                chunk.slice(0, KVT).store(gl.where(new, knew_f, kt))
                chunk.slice(KVT, KVT).store(gl.where(new, vnew_f, gl.where((t0 + rf < hi)[:, None], vt, 0.0)))
            fence_async_shared()    # every write to the slot here or in patch_rows, before wgmma reads it
            barrier()
            # scores^T [KVT, GP]: the keys [KVT, HD] (M) by q^T [HD, GP] (N)
            sc = warpgroup_mma(chunk.slice(0, KVT), q_s.permute((1, 0)), s0, use_acc=False, is_async=True)
            sc = warpgroup_mma_wait(num_outstanding=0, deps=(sc,)) * scale
        if AW:
            if tail:
                sc = gl.where((t0 + tok < hi)[:, None], sc, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(sc, axis=0))
            p = gl.exp(sc - m_new[None, :])
            alpha = gl.exp(m_i - m_new)
            lp = lp * alpha[None, :] + p
            ot = ot * alpha[None, :]
            if NHB > 1:
                ot2 = ot2 * alpha[None, :]
            m_i = m_new
            p_s.permute((1, 0)).store(p.to(gl.bfloat16))
            fence_async_shared()
            barrier()
            # outputs^T [HD, GP] += the values^T [HD, KVT] (M) by the probabilities [KVT, GP] (N); over
            # head_dim 64, a [KW, GP] product a column block
            if NHB > 1:
                ot = warpgroup_mma(kv3.index(0).permute((1, 0)), p_s.permute((1, 0)), ot, is_async=True)
                ot2 = warpgroup_mma(kv3.index(1).permute((1, 0)), p_s.permute((1, 0)), ot2, is_async=True)
                ot, ot2 = warpgroup_mma_wait(num_outstanding=0, deps=(ot, ot2))
            elif KS:                # head_dim 64 in a slot of its own: one column block
                ot = warpgroup_mma(kv3.index(0).permute((1, 0)), p_s.permute((1, 0)), ot, is_async=True)
                ot = warpgroup_mma_wait(num_outstanding=0, deps=(ot,))
            else:
                ot = warpgroup_mma(chunk.slice(KVT, KVT).permute((1, 0)), p_s.permute((1, 0)), ot, is_async=True)
                ot = warpgroup_mma_wait(num_outstanding=0, deps=(ot,))
        else:
            for sub in gl.static_range(KVT // TILE):
                ta = t0 + sub * TILE
                # a tile inside the share and without the new token (all but a share's last, or the
                # step's) takes its rows as they are: the masks below are a quarter of the tile's work
                if (ta + TILE <= hi) & ((n_ctx - 1 < ta) | (n_ctx - 1 >= ta + TILE)):
                    kt = chunk.slice(sub * TILE, TILE).load(KL).to(gl.float32)
                    vt = chunk.slice(KVT + sub * TILE, TILE).load(KL).to(gl.float32)
                    sc = gl.sum(q[:, None, :] * kt[None, :, :], axis=2) * scale
                else:
                    toks = ta + tk
                    live = (toks < hi)[:, None]
                    new = (toks == n_ctx - 1)[:, None]
                    # rows past the share are zeros or another share's: masked, so a NaN there cannot leak
                    kt = gl.where(new, knew,
                                  gl.where(live, chunk.slice(sub * TILE, TILE).load(KL).to(gl.float32), 0.0))
                    vt = gl.where(new, vnew,
                                  gl.where(live, chunk.slice(KVT + sub * TILE, TILE).load(KL).to(gl.float32), 0.0))
                    sc = gl.sum(q[:, None, :] * kt[None, :, :], axis=2) * scale
                    sc = gl.where((ta + ts < hi)[None, :], sc, float("-inf"))
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
    if TRACE:
        gl.store(trace + i * TRACE_WORDS + 6, dwait)
    if AW:                          # the outputs and sums into the layouts below, through x's shared memory
        l_i = gl.convert_layout(gl.sum(lp, axis=0), gl.SliceLayout(1, SL))
        m_i = gl.convert_layout(m_i, gl.SliceLayout(1, SL))
        if NHB > 1:
            o_s.slice(0, KW, dim=1).permute((1, 0)).store(ot)
            o_s.slice(KW, KW, dim=1).permute((1, 0)).store(ot2)
        else:
            o_s.permute((1, 0)).store(ot)
        barrier()
        acc = o_s.load(QL)
        barrier()                   # every warp has its outputs before x's shared memory is another node's
    jo = gl.arange(0, GP, layout=gl.SliceLayout(1, QL))
    if splits == 1:
        o = acc / gl.convert_layout(l_i, gl.SliceLayout(1, QL))[:, None]
        if XB:                      # a constexpr branch (a batch-1 kernel's outputs are fp32)
            store_out(arena, out, head0, grp, o, jo, dq, base + A_OBF, XB, HD)
        else:
            gl.store(arena + out + (head0 + jo)[:, None] * HD + dq[None, :], o, mask=(jo < grp)[:, None])
    elif busy:
        pb = arena + part + split * grp * (HD + 2)
        gl.store(pb + jo[:, None] * HD + dq[None, :], acc, mask=(jo < grp)[:, None])
        js = gl.arange(0, GP, layout=gl.SliceLayout(1, SL))
        gl.store(pb + grp * HD + js, m_i, mask=js < grp)
        gl.store(pb + grp * HD + grp + js, l_i, mask=js < grp)
        take_ticket(arena, counters, ticket, part, out, head0, grp, n_ctx, splits, base + A_OBF, CW, HD, GP, KVT,
                    XB)
    return it, failed
