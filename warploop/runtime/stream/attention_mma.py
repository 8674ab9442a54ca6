"""The attention body's chunks on tensor cores (StreamConfig.attn_mma; attention.py's attn
dispatches to it after its waits and the new token's KV write).

Each token warp takes WT tokens of a step and keeps its own running max, sum and output; the
scores and the output are mma_v2 products (q and the probabilities as bf16, the sums fp32), and
the warps' states merge once per share (reference._warp_softmax rounds the same way)."""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, mma_v2

from warploop.runtime.stream.kv_rows import KV_LAYOUT, patch_rows, rope
from warploop.runtime.stream.shares import take_ticket
from warploop.runtime.stream.sync import PUBLIC_REINTERPRET, TRACE_WORDS, barrier, now

KV_LAYOUT3 = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, order=[2, 1, 0]))   # the same plain rows, 3-D
WT = gl.constexpr(16)           # a warp's tokens a step (an mma's K side in the output products)


@gluon.jit
def q_rows(arena, qkv, head0, grp, busy, csq, snq, wq, wqp, eps, qn, CW: gl.constexpr, HD: gl.constexpr):
    """The group's q heads normed and rotated as attn's, padded to an mma's 16 rows (the padding
    repeats the last head), in the layout attend_mma makes every warp's copy from."""
    HALF: gl.constexpr = HD // 2
    QM: gl.constexpr = gl.SliceLayout(0, gl.BlockedLayout([1, 1, 8], [1, 32 // (HD // 8), HD // 8], [CW, 1, 1],
                                                          [2, 1, 0]))
    dq = gl.arange(0, HD, layout=gl.SliceLayout(0, QM))
    dqp = gl.where(dq < HALF, dq + HALF, dq - HALF)
    jq = gl.minimum(gl.arange(0, 16, layout=gl.SliceLayout(1, QM)), grp - 1)
    src = qkv + (head0 + jq) * HD
    return rope(gl.load(arena + src[:, None] + dq[None, :], mask=busy, other=0.0, cache_modifier=".cg"),
                 gl.load(arena + src[:, None] + dqp[None, :], mask=busy, other=0.0, cache_modifier=".cg"),
                 gl.convert_layout(wq, gl.SliceLayout(0, QM)), gl.convert_layout(wqp, gl.SliceLayout(0, QM)),
                 gl.convert_layout(csq, gl.SliceLayout(0, QM)), gl.convert_layout(snq, gl.SliceLayout(0, QM)),
                 eps, qn >= 0, HD, dq)


@gluon.jit
def attend_mma(arena, bufs, full, empty, it, counters, trace, i, q, out, head0, grp, scale, split, splits, part,
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
            patch_rows(chunk, t0, ca, cb, row_a, in_a, row_b, in_b, ints, step, bs, f0, f1, fresh, row_words,
                       g, kc, vc, rf, df, k_new, v_new, last, True, FL, HD, KVT)
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
        take_ticket(arena, counters, ticket, part, out, head0, grp, n_ctx, splits, CW, HD, GP, KVT)
    return it
