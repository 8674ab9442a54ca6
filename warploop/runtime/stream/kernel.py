"""The streaming executor's kernel, in Gluon (Hopper: TMA, mbarriers, warp specialization).

One CTA per SM runs its static instruction list (program.py builds it) with two roles:

- the loader, one warp with a small register budget, walks the list and streams every node's
  streamed operand (kinds.Streamed) into a ring of NBUF shared-memory slots of [BR, BK] by TMA.
  It waits only for free slots, never on a dependency, so it runs ahead into later stages;
- the consumer, one warpgroup, walks the same list: it waits on the node's dependency counters
  (bounded polls, then one acquire), stages the node's input vector in shared memory, computes from
  the ring chunk by chunk, releases each slot, writes its outputs and publishes its counter with a
  release atomic.

Ring protocol: chunk number `it` (counted alike by both roles) lives in slot it % NBUF, and
(it // NBUF) & 1 is the parity of that slot's use. full[slot] completes when TMA has written the
chunk (expect-tx); empty[slot] when the consumer has read it. A fresh mbarrier passes a wait for
parity 1, so the loader's first pass over the ring does not block.

Counters only grow: run `epoch` (0-based) of a wait on (counter, need) is met at need * (epoch + 1).
A wait that polls SPIN times in vain records (1, counter, CTA, instruction) in err and stops
waiting from then on, so the kernel always ends and the host raises with those words.

Triton 3.6 and 3.9 name two builtins differently; the aliases below take whichever exists.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from warploop.runtime.stream.kinds import ATTN, COMBINE, EPILOGUES, GEMV, WORDS, header_word

_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
PUBLIC_REINTERPRET = gl.constexpr(hasattr(gl.shared_memory_descriptor, "reinterpret"))   # 3.6: _reinterpret

W = gl.constexpr(WORDS)
H_OP = gl.constexpr(header_word("op"))
H_WAIT0 = gl.constexpr(header_word("wait0"))
H_NEED0 = gl.constexpr(header_word("need0"))
H_WAIT1 = gl.constexpr(header_word("wait1"))
H_NEED1 = gl.constexpr(header_word("need1"))
H_SIGNAL = gl.constexpr(header_word("signal"))
H_SIGNALS = gl.constexpr(header_word("signals"))
OP_GEMV = gl.constexpr(GEMV.opcode)
G_POOL = gl.constexpr(GEMV.word(GEMV.streamed.pool))
G_ROW = gl.constexpr(GEMV.word(GEMV.streamed.row))
G_K = gl.constexpr(GEMV.word(GEMV.streamed.width))
G_ROWS = gl.constexpr(GEMV.word("rows"))
G_X = gl.constexpr(GEMV.word("x"))
G_OUT = gl.constexpr(GEMV.word("out"))
G_NORM = gl.constexpr(GEMV.word("norm"))
G_BIAS = gl.constexpr(GEMV.word("bias"))
G_EPI = gl.constexpr(GEMV.word("epi"))
G_EPS = gl.constexpr(GEMV.word("eps"))
OP_ATTN = gl.constexpr(ATTN.opcode)
A = {f.name: gl.constexpr(ATTN.word(f.name)) for f in ATTN.fields}
A_QKV, A_OUT, A_HEAD, A_KVHEAD, A_GROUP = A["qkv"], A["out"], A["head"], A["kvhead"], A["group"]
A_HEADS, A_KVHEADS, A_STEP, A_COS, A_SIN = A["heads"], A["kvheads"], A["step"], A["cos"], A["sin"]
A_QN, A_KN, A_LAYER, A_BLOCKS, A_BS, A_EPS, A_SCALE = A["qn"], A["kn"], A["layer"], A["blocks"], A["bs"], \
    A["eps"], A["scale"]
A_SPLIT, A_SPLITS, A_PART = A["split"], A["splits"], A["part"]
OP_COMBINE = gl.constexpr(COMBINE.opcode)
C_PART, C_OUT, C_HEAD = gl.constexpr(COMBINE.word("part")), gl.constexpr(COMBINE.word("out")), \
    gl.constexpr(COMBINE.word("head"))
C_GROUP, C_SPLITS = gl.constexpr(COMBINE.word("group")), gl.constexpr(COMBINE.word("splits"))
EPI_ADD = gl.constexpr(EPILOGUES["add"])
EPI_SILU = gl.constexpr(EPILOGUES["silu_mul"])
TRACE_WORDS = gl.constexpr(4)   # with TRACE: ns stamps per instruction (start, waited, first chunk, published)
CW = gl.constexpr(4)            # the consumer's warps: one warpgroup (two measured no faster)
LOADER_WARPS = gl.constexpr(1)
LOADER_REGS = gl.constexpr(40)


@gluon.jit
def _now():
    return gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=gl.int64, is_pure=False, pack=1)


@gluon.jit
def _loader(d0, d1, d2, d3, bufs, full, empty, instr, n, BR: gl.constexpr, BK: gl.constexpr,
            NBUF: gl.constexpr):
    it = 0
    op = gl.load(instr + H_OP)
    pool = gl.load(instr + G_POOL)
    row = gl.load(instr + G_ROW)
    k = gl.load(instr + G_K)
    i = 0
    while i < n:                  # the next instruction's words load while this one streams
        nb = instr + gl.minimum(i + 1, gl.maximum(n - 1, 0)) * W
        n_op = gl.load(nb + H_OP)
        n_pool = gl.load(nb + G_POOL)
        n_row = gl.load(nb + G_ROW)
        n_k = gl.load(nb + G_K)
        if op == OP_GEMV:
            kk = 0
            while kk < k:
                slot = it % NBUF
                mbarrier.wait(empty.index(slot), ((it // NBUF) & 1) ^ 1)
                bar = full.index(slot)
                mbarrier.expect(bar, BR * BK * 2)
                dst = bufs.index(slot)
                if pool == 0:
                    _tma_load(d0, [row, kk], bar, dst)
                elif pool == 1:
                    _tma_load(d1, [row, kk], bar, dst)
                elif pool == 2:
                    _tma_load(d2, [row, kk], bar, dst)
                else:
                    _tma_load(d3, [row, kk], bar, dst)
                it += 1
                kk += BK
        op, pool, row, k = n_op, n_pool, n_row, n_k
        i += 1


@gluon.jit
def _rope_head(arena, src, d, cs, sn, w, eps, NORM, HD: gl.constexpr):
    """Rows src[j] (arena offsets of heads, [R] tensor) RMS-normed by w (when NORM) and rotated by
    the RoPE rows cs, sn ([HD], the half-rows repeated): the halves convention, x * cos + rot(x) * sin
    with rot(x) = (-x2, x1)."""
    HALF: gl.constexpr = HD // 2
    dp = gl.where(d < HALF, d + HALF, d - HALF)
    sign = gl.where(d < HALF, -1.0, 1.0)
    x = gl.load(arena + src[:, None] + d[None, :])
    xp = gl.load(arena + src[:, None] + dp[None, :])
    if NORM:
        r = gl.rsqrt(gl.sum(x * x, axis=1) / HD + eps)[:, None]
        x = x * r * gl.load(arena + w + d)[None, :]
        xp = xp * r * gl.load(arena + w + dp)[None, :]
    return x * cs[None, :] + sign[None, :] * xp * sn[None, :]


@gluon.jit
def _attn(arena, ints, kv, base, HD: gl.constexpr, GP: gl.constexpr, TILE: gl.constexpr):
    """The ATTN kind's body (kinds.ATTN), after its waits. fp32 throughout; k and v rounded to the
    cache's bf16 once, as stored, and used in that form for the new token too."""
    HALF: gl.constexpr = HD // 2
    L3: gl.constexpr = gl.BlockedLayout([1, 1, 8], [1, 32 // (HD // 8), HD // 8], [1, CW, 1], [2, 1, 0])
    QL: gl.constexpr = gl.SliceLayout(1, L3)          # [GP, HD]: q heads, the output
    KL: gl.constexpr = gl.SliceLayout(0, L3)          # [TILE, HD]: a tile of keys or values
    SL: gl.constexpr = gl.SliceLayout(2, L3)          # [GP, TILE]: scores
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
    pos = gl.load(ints + step)
    n_ctx = gl.load(ints + step + 1)
    slot = gl.load(ints + step + 2)
    # this split's tokens [lo, hi): whole tiles, the last split takes what is left
    chunk = ((n_ctx + splits - 1) // splits + TILE - 1) // TILE * TILE
    lo = gl.minimum(split * chunk, n_ctx)
    hi = gl.minimum(lo + chunk, n_ctx)
    row_words = (kvh * HD).to(gl.int64)
    kc = kv + layer.to(gl.int64) * 2 * blocks * bs * row_words
    vc = kc + blocks.to(gl.int64) * bs * row_words
    # q heads of the group, in the scores' row layout
    dq = gl.arange(0, HD, layout=gl.SliceLayout(0, QL))
    jq = gl.arange(0, GP, layout=gl.SliceLayout(1, QL))
    jq = gl.minimum(jq, grp - 1)                       # padded rows repeat the last head (not stored)
    csq = gl.load(arena + cos_t + pos * HALF + dq % HALF)
    snq = gl.load(arena + sin_t + pos * HALF + dq % HALF)
    q = _rope_head(arena, qkv + (head0 + jq) * HD, dq, csq, snq, qn, eps, qn >= 0, HD)
    # the new token's k and v, in a tile's layout (row 0 of a [1, HD] tile)
    dk = gl.arange(0, HD, layout=gl.SliceLayout(0, KL))
    one = gl.arange(0, 1, layout=gl.SliceLayout(1, KL))
    csk = gl.load(arena + cos_t + pos * HALF + dk % HALF)
    snk = gl.load(arena + sin_t + pos * HALF + dk % HALF)
    knew = _rope_head(arena, qkv + (heads + g) * HD + one, dk, csk, snk, kn, eps, kn >= 0, HD)
    knew = knew.to(gl.bfloat16)
    vnew = gl.load(arena + qkv + (heads + kvh + g) * HD + one[:, None] + dk[None, :]).to(gl.bfloat16)
    if (slot >= 0) & (lo <= n_ctx - 1) & (n_ctx - 1 < hi):     # the split holding the new token
        dst = slot.to(gl.int64) * row_words + g * HD + one[:, None] + dk[None, :]
        gl.store(kc + dst, knew)
        gl.store(vc + dst, vnew)
    knew = knew.to(gl.float32)
    vnew = vnew.to(gl.float32)
    tk = gl.arange(0, TILE, layout=gl.SliceLayout(1, KL))
    m_i = gl.full([GP], float("-inf"), gl.float32, layout=gl.SliceLayout(1, SL))
    l_i = gl.zeros([GP], gl.float32, layout=gl.SliceLayout(1, SL))
    acc = gl.zeros([GP, HD], gl.float32, layout=QL)
    ts = gl.arange(0, TILE, layout=gl.SliceLayout(0, SL))
    t0 = lo
    while t0 < hi:
        toks = t0 + tk
        live = toks < hi
        blk = gl.load(ints + step + 3 + toks // bs, mask=live, other=0)
        rows = (blk.to(gl.int64) * bs + toks % bs) * row_words + g * HD
        addr = rows[:, None] + dk[None, :]
        m2 = live[:, None]
        kt = gl.load(kc + addr, mask=m2, other=0.0).to(gl.float32)
        vt = gl.load(vc + addr, mask=m2, other=0.0).to(gl.float32)
        new = (toks == n_ctx - 1)[:, None]
        kt = gl.where(new, knew, kt)
        vt = gl.where(new, vnew, vt)
        sc = gl.sum(q[:, None, :] * kt[None, :, :], axis=2) * scale
        sc = gl.where((t0 + ts < hi)[None, :], sc, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(sc, axis=1))
        p = gl.exp(sc - m_new[:, None])
        alpha = gl.exp(m_i - m_new)
        l_i = l_i * alpha + gl.sum(p, axis=1)
        a_q = gl.convert_layout(alpha, gl.SliceLayout(1, QL))
        acc = acc * a_q[:, None] + gl.sum(p[:, :, None] * vt[None, :, :], axis=1)
        m_i = m_new
        t0 += TILE
    jo = gl.arange(0, GP, layout=gl.SliceLayout(1, QL))
    if splits == 1:
        o = acc / gl.convert_layout(l_i, gl.SliceLayout(1, QL))[:, None]
        gl.store(arena + out + (head0 + jo)[:, None] * HD + dq[None, :], o, mask=(jo < grp)[:, None])
    else:
        pb = arena + part + split * grp * (HD + 2)
        gl.store(pb + jo[:, None] * HD + dq[None, :], acc, mask=(jo < grp)[:, None])
        js = gl.arange(0, GP, layout=gl.SliceLayout(1, SL))
        gl.store(pb + grp * HD + js, m_i, mask=js < grp)
        gl.store(pb + grp * HD + grp + js, l_i, mask=js < grp)


@gluon.jit
def _combine(arena, base, HD: gl.constexpr, GP: gl.constexpr):
    """The COMBINE kind's body: out = sum_s acc_s e^(m_s - M) / sum_s l_s e^(m_s - M), M = max_s m_s."""
    L3: gl.constexpr = gl.BlockedLayout([1, 1, 8], [1, 32 // (HD // 8), HD // 8], [1, CW, 1], [2, 1, 0])
    QL: gl.constexpr = gl.SliceLayout(1, L3)
    part = gl.load(base + C_PART)
    out = gl.load(base + C_OUT)
    head0 = gl.load(base + C_HEAD)
    grp = gl.load(base + C_GROUP)
    splits = gl.load(base + C_SPLITS)
    j = gl.arange(0, GP, layout=gl.SliceLayout(1, QL))
    jm = gl.minimum(j, grp - 1)
    d = gl.arange(0, HD, layout=gl.SliceLayout(0, QL))
    stride = grp * (HD + 2)
    big = gl.full([GP], float("-inf"), gl.float32, layout=gl.SliceLayout(1, QL))
    for s in range(splits):
        big = gl.maximum(big, gl.load(arena + part + s * stride + grp * HD + jm, cache_modifier=".cg"))
    num = gl.zeros([GP, HD], gl.float32, layout=QL)
    den = gl.zeros([GP], gl.float32, layout=gl.SliceLayout(1, QL))
    for s in range(splits):
        pb = arena + part + s * stride
        w = gl.exp(gl.load(pb + grp * HD + jm, cache_modifier=".cg") - big)
        den += w * gl.load(pb + grp * HD + grp + jm, cache_modifier=".cg")
        num += w[:, None] * gl.load(pb + jm[:, None] * HD + d[None, :], cache_modifier=".cg")
    gl.store(arena + out + (head0 + j)[:, None] * HD + d[None, :], num / den[:, None], mask=(j < grp)[:, None])


@gluon.jit
def _wait(counters, err, c, target, failed, cta, i, SPIN: gl.constexpr):
    """Poll counter c with acquire loads until it reaches target (at most SPIN polls; none once a
    wait has failed): the load that sees the target also orders what follows. Returns `failed`."""
    cptr = counters + c
    limit = SPIN * (1 - failed)
    polls = 0
    cnt = gl.atomic_add(cptr, 0, sem="acquire", scope="gpu")
    while (cnt < target) & (polls < limit):
        cnt = gl.atomic_add(cptr, 0, sem="acquire", scope="gpu")
        polls += 1
    if cnt < target:
        failed = 1
        gl.store(err + 1, c)
        gl.store(err + 2, cta)
        gl.store(err + 3, i)
        gl.store(err + 0, 1)
    return failed


@gluon.jit
def _consumer(bufs, full, empty, xs, instr, n, arena, ints, kv, counters, err, epoch, cta, trace, BR: gl.constexpr,
              BK: gl.constexpr, NBUF: gl.constexpr, KMAX: gl.constexpr, SPIN: gl.constexpr, TRACE: gl.constexpr,
              HD: gl.constexpr, GP: gl.constexpr, TILE: gl.constexpr):
    HALF: gl.constexpr = BR // 2
    # A thread holds 8 contiguous bf16 (16 B) of a row and a warp 256 contiguous columns, so the
    # unswizzled chunk is read without bank conflicts and a row's sum stays inside a warp.
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (BK // 8), BK // 8], [CW, 1], [1, 0])
    rows = gl.arange(0, HALF, layout=gl.SliceLayout(1, layout))
    # x is staged as [KMAX // BK, BK] and read back through a [KMAX // BK, 1, BK] view of the same
    # bytes: chunk c is then a [1, BK] tile in the chunks' own layout
    xl: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [CW, 1], [1, 0])
    if PUBLIC_REINTERPRET:
        xrows = xs.reinterpret(gl.float32, [KMAX // BK, 1, BK], xs.layout)
    else:
        xrows = xs._reinterpret(gl.float32, [KMAX // BK, 1, BK], xs.layout)
    xidx = (gl.arange(0, KMAX // BK, layout=gl.SliceLayout(1, xl))[:, None] * BK
            + gl.arange(0, BK, layout=gl.SliceLayout(0, xl))[None, :])
    it = 0
    failed = 0
    staged_x = -1
    staged_norm = -2
    staged_k = -1
    scale = 1.0               # the staged input's RMSNorm scale (1: no norm)
    # The instruction's words are loaded one instruction ahead (off the critical path). While
    # loops, not range(): Triton 3.6 drops a loop-carried scalar from the outer loop when its only
    # use is an inner range() bound.
    op = gl.load(instr + H_OP)
    w0 = gl.load(instr + H_WAIT0)
    n0 = gl.load(instr + H_NEED0)
    w1 = gl.load(instr + H_WAIT1)
    n1 = gl.load(instr + H_NEED1)
    sig = gl.load(instr + H_SIGNAL)
    sigs = gl.load(instr + H_SIGNALS)
    k = gl.load(instr + G_K)
    x = gl.load(instr + G_X)
    norm = gl.load(instr + G_NORM)
    eps = gl.load(instr + G_EPS).to(gl.float32, bitcast=True)
    rows_n = gl.load(instr + G_ROWS)
    out = gl.load(instr + G_OUT)
    bias = gl.load(instr + G_BIAS)
    epi = gl.load(instr + G_EPI)
    i = 0
    while i < n:
        nb = instr + gl.minimum(i + 1, gl.maximum(n - 1, 0)) * W
        n_op = gl.load(nb + H_OP)
        n_w0 = gl.load(nb + H_WAIT0)
        n_n0 = gl.load(nb + H_NEED0)
        n_w1 = gl.load(nb + H_WAIT1)
        n_n1 = gl.load(nb + H_NEED1)
        n_sig = gl.load(nb + H_SIGNAL)
        n_sigs = gl.load(nb + H_SIGNALS)
        n_k = gl.load(nb + G_K)
        n_x = gl.load(nb + G_X)
        n_norm = gl.load(nb + G_NORM)
        n_eps = gl.load(nb + G_EPS).to(gl.float32, bitcast=True)
        n_rows = gl.load(nb + G_ROWS)
        n_out = gl.load(nb + G_OUT)
        n_bias = gl.load(nb + G_BIAS)
        n_epi = gl.load(nb + G_EPI)
        restage = (w0 >= 0) | (w1 >= 0) | (x != staged_x) | (norm != staged_norm) | (k != staged_k)
        gemv = op == OP_GEMV
        ma = rows < rows_n
        mb = rows + HALF < rows_n
        # what no predecessor writes is read before the wait: the norm weights and the bias
        nw = gl.load(arena + norm + xidx, mask=(xidx < k) & (norm >= 0) & restage & gemv, other=0.0)
        has_bias = (bias >= 0) & gemv & (epi != EPI_SILU)
        ba = gl.load(arena + bias + rows, mask=ma & has_bias, other=0.0)
        bb = gl.load(arena + bias + HALF + rows, mask=mb & has_bias, other=0.0)
        if TRACE:
            gl.store(trace + i * TRACE_WORDS, _now())
        if w0 >= 0:
            failed = _wait(counters, err, w0, n0 * (epoch + 1), failed, cta, i, SPIN)
        if w1 >= 0:
            failed = _wait(counters, err, w1, n1 * (epoch + 1), failed, cta, i, SPIN)
        if TRACE:
            gl.store(trace + i * TRACE_WORDS + 1, _now())
        if gemv:
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
                xv = gl.load(arena + x + xidx, mask=xidx < k, other=0.0, cache_modifier=".cg")
                if norm >= 0:
                    ss_rows = gl.sum(xv * xv, axis=1)
                    xv = xv * nw
                _barrier()            # every thread is done with the previous x
                xs.store(xv)
                _barrier()
                staged_x = x
                staged_norm = norm
                staged_k = k
            # products accumulate elementwise; the rows are summed across lanes once, after the
            # last chunk (a cross-lane reduction per chunk costs more than the chunk's FMAs)
            part_a = gl.zeros([HALF, BK], gl.float32, layout=layout)
            part_b = gl.zeros([HALF, BK], gl.float32, layout=layout)
            c = 0
            while c < (k + BK - 1) // BK:
                slot = it % NBUF
                xc = xrows.index(c).load(layout)          # [1, BK]: broadcast over the rows
                mbarrier.wait(full.index(slot), (it // NBUF) & 1)
                if TRACE:
                    if c == 0:
                        gl.store(trace + i * TRACE_WORDS + 2, _now())
                buf = bufs.index(slot)
                wa = buf.slice(0, HALF).load(layout)
                wb = buf.slice(HALF, HALF).load(layout)
                part_a += wa.to(gl.float32) * xc
                part_b += wb.to(gl.float32) * xc
                # every warp is done with the slot before one thread frees it; the proxy fence
                # orders these reads before the next TMA write into it
                _barrier()
                fence_async_shared()
                mbarrier.arrive(empty.index(slot))
                it += 1
                c += 1
            if restage:
                scale = 1.0
                if norm >= 0:
                    scale = gl.rsqrt(gl.sum(ss_rows, axis=0) / k + eps)
            acc_a = old_a + scale * gl.sum(part_a, axis=1)
            acc_b = old_b + scale * gl.sum(part_b, axis=1)
            if epi == EPI_SILU:
                y = acc_a / (1.0 + gl.exp(-acc_a)) * acc_b
                gl.store(arena + out + rows, y, mask=ma)
            else:
                gl.store(arena + out + rows, acc_a, mask=ma)
                gl.store(arena + out + HALF + rows, acc_b, mask=mb)
            if (out < staged_x + staged_k) & (out + BR > staged_x):
                staged_x = -1         # this node wrote over the staged input
        if HD != 0:
            if op == OP_ATTN:
                _attn(arena, ints, kv, instr + i * W, HD, GP, TILE)
                staged_x = -1         # its output may be a later node's input
            if op == OP_COMBINE:
                _combine(arena, instr + i * W, HD, GP)
                staged_x = -1
        if sig >= 0:
            _barrier()                # every thread's stores precede the one release below
            gl.atomic_add(counters + sig, sigs, sem="release", scope="gpu")
        if TRACE:
            gl.store(trace + i * TRACE_WORDS + 3, _now())
        op, w0, n0, w1, n1, sig, sigs = n_op, n_w0, n_n0, n_w1, n_n1, n_sig, n_sigs
        k, x, norm, eps, rows_n, out, bias, epi = n_k, n_x, n_norm, n_eps, n_rows, n_out, n_bias, n_epi
        i += 1


@gluon.jit(do_not_specialize=["epoch"])
def stream_kernel(d0, d1, d2, d3, instr, table, arena, ints, kv, counters, err, epoch, trace, BR: gl.constexpr,
                  BK: gl.constexpr, NBUF: gl.constexpr, KMAX: gl.constexpr, SPIN: gl.constexpr,
                  TRACE: gl.constexpr, HD: gl.constexpr, GP: gl.constexpr, TILE: gl.constexpr):
    cta = gl.program_id(0)
    first = gl.load(table + 2 * cta)
    n = gl.load(table + 2 * cta + 1)
    mine = instr + first * W
    bufs = gl.allocate_shared_memory(gl.bfloat16, [NBUF, BR, BK], d0.layout)
    xs = gl.allocate_shared_memory(gl.float32, [KMAX // BK, BK], gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))
    full = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(NBUF):
        mbarrier.init(full.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
    fence_async_shared()
    gl.warp_specialize([
        (_consumer, (bufs, full, empty, xs, mine, n, arena, ints, kv, counters, err, epoch, cta,
                     trace + first * TRACE_WORDS, BR, BK, NBUF, KMAX, SPIN, TRACE, HD, GP, TILE)),
        (_loader, (d0, d1, d2, d3, bufs, full, empty, mine, n, BR, BK, NBUF)),
    ], [LOADER_WARPS], [LOADER_REGS])
