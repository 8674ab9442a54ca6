"""The streaming kernel's node kinds with no streamed operand (EMBED, SAMPLE, NOP, ALLREDUCE in a
tensor-parallel kernel: allreduce.py, CAST in a batched kernel): their waits, then their bodies, run
by the consumer (kernel.py)."""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from warploop.runtime.stream.allreduce import OP_ALLREDUCE, allreduce
from warploop.runtime.stream.kinds import CAST, EMBED, SAMPLE
from warploop.runtime.stream.sync import TRACE_WORDS, now, waits

OP_EMBED = gl.constexpr(EMBED.opcode)
E_TOKEN, E_OUT, E_K = gl.constexpr(EMBED.word("token")), gl.constexpr(EMBED.word("out")), gl.constexpr(EMBED.word("k"))
E_ROWS, E_FIRST, E_SHARD = gl.constexpr(EMBED.word("rows")), gl.constexpr(EMBED.word("first")), \
    gl.constexpr(EMBED.word("shard"))
OP_SAMPLE = gl.constexpr(SAMPLE.opcode)
S_PAIRS, S_COUNT, S_BASE = gl.constexpr(SAMPLE.word("pairs")), gl.constexpr(SAMPLE.word("count")), \
    gl.constexpr(SAMPLE.word("base"))
S_TOKEN, S_TOKENS = gl.constexpr(SAMPLE.word("token")), gl.constexpr(SAMPLE.word("tokens"))
S_PER, S_SHARD = gl.constexpr(SAMPLE.word("per")), gl.constexpr(SAMPLE.word("shard"))
SBLK = gl.constexpr(4096)       # amax pairs a SAMPLE reduces per round
OP_CAST = gl.constexpr(CAST.opcode)
C_X, C_OUT, C_K = gl.constexpr(CAST.word("x")), gl.constexpr(CAST.word("out")), gl.constexpr(CAST.word("k"))
C_NORM, C_EPS = gl.constexpr(CAST.word("norm")), gl.constexpr(CAST.word("eps"))
C_PART, C_PARTS, C_PSTRIDE = gl.constexpr(CAST.word("part")), gl.constexpr(CAST.word("parts")), \
    gl.constexpr(CAST.word("pstride"))


@gluon.jit
def _embed(arena, ints, emb, base, xidx):
    """The EMBED kind's body: out[:k] = float(emb[ints[token] - first, :k]); with shard, zeros for a
    token outside the table's rows."""
    k = gl.load(base + E_K)
    rows = gl.load(base + E_ROWS)
    # the token is the step before's SAMPLE's (another SM's store, ordered by the wait): from L2
    local = gl.load(ints + gl.load(base + E_TOKEN), cache_modifier=".cg") - gl.load(base + E_FIRST)
    mine = (gl.load(base + E_SHARD) == 0) | ((local >= 0) & (local < rows))
    row = emb + gl.minimum(gl.maximum(local, 0), rows - 1).to(gl.int64) * k
    gl.store(arena + gl.load(base + E_OUT) + xidx,
             gl.load(row + xidx, mask=(xidx < k) & mine, other=0.0).to(gl.float32), mask=xidx < k)


# The values a CAST node holds at once (x, its partials, the norm weights): 2,048 where attention's head
# is 64 wide or less, 1,024 over it (H200, batch 32, ms a step: Qwen3-0.6B 1.722 with 1,024 against 1.738
# with 2,048, bench/results/stream-batched-kernel-trim-h200-20261130.jsonl; before the batched kernels
# dropped the batch-1 GEMV body, 1.762 against 2.006, the kernel's stack 120 against 256 bytes; and
# Llama-3.2-1B 1.532 -> 1.323 against the KMAX span, bench/results/stream-cast-block-h200-20261130.jsonl)
CAST_BLOCK = gl.constexpr(2048)


@gluon.jit
def _embed_blocks(arena, ints, emb, base, KMAX: gl.constexpr, CW: gl.constexpr):
    """_embed in a batched kernel: the row in blocks of CAST_BLOCK values (a thread's four consecutive
    ones a vector), not the kernel's KMAX span (64 values a thread at 8,192, held in registers)."""
    CB: gl.constexpr = min(KMAX, CAST_BLOCK)
    idx = gl.arange(0, CB, layout=gl.BlockedLayout([4], [32], [CW], [0]))
    k = gl.load(base + E_K)
    rows = gl.load(base + E_ROWS)
    local = gl.load(ints + gl.load(base + E_TOKEN), cache_modifier=".cg") - gl.load(base + E_FIRST)
    mine = (gl.load(base + E_SHARD) == 0) | ((local >= 0) & (local < rows))
    row = emb + gl.minimum(gl.maximum(local, 0), rows - 1).to(gl.int64) * k + idx
    at = arena + gl.load(base + E_OUT) + idx
    c = 0
    while c < k:
        live = idx < k - c
        gl.store(at + c, gl.load(row + c, mask=live & mine, other=0.0).to(gl.float32), mask=live)
        c += CB


@gluon.jit
def _cast_sum(arena, at_x, part, pstride, parts, live, SK: gl.constexpr):
    """x's block plus the split-K partials at part + s * pstride (s = 0 .. parts - 1, added in turn),
    four loads in flight at a time (each is an L2 round trip: a loop of one load an iteration waits
    on each in turn)."""
    xv = gl.load(at_x, mask=live, other=0.0, cache_modifier=".cg")
    if not SK:
        return xv
    s = 0
    while s < parts:
        at = part + s * pstride
        p0 = gl.load(at, mask=live, other=0.0, cache_modifier=".cg")
        p1 = gl.load(at + pstride, mask=live & (s + 1 < parts), other=0.0, cache_modifier=".cg")
        p2 = gl.load(at + 2 * pstride, mask=live & (s + 2 < parts), other=0.0, cache_modifier=".cg")
        p3 = gl.load(at + 3 * pstride, mask=live & (s + 3 < parts), other=0.0, cache_modifier=".cg")
        xv = xv + p0
        xv = xv + p1
        xv = xv + p2
        xv = xv + p3
        s += 4
    return xv


@gluon.jit
def _cast(arena, base, KMAX: gl.constexpr, CW: gl.constexpr, SK: gl.constexpr, HD: gl.constexpr):
    """The CAST kind's body: x[:k] (plus a split-K GEMV's partial sums in split order, written back
    to x), RMS-normalised with norm >= 0, as bf16 from bf16 element 2 * out, in blocks of CB values
    (a thread's four consecutive floats a vector load): a row of k <= CB (every model's hidden size
    to 2,048) is loaded once with its partials and norm weights all in flight; a wider one is summed
    block by block, then normalised from x again. SK: the merge compiled in (a kernel of 64-row
    tiles, the split tiles' only kind); HD: attention's head size (CAST_BLOCK)."""
    CB: gl.constexpr = min(KMAX, CAST_BLOCK if HD <= 64 else CAST_BLOCK // 2)
    L: gl.constexpr = gl.BlockedLayout([4], [32], [CW], [0])
    idx = gl.arange(0, CB, layout=L)
    k = gl.load(base + C_K)
    norm = gl.load(base + C_NORM)
    eps = gl.load(base + C_EPS).to(gl.float32, bitcast=True)
    # x and the partials are predecessors' outputs (other SMs' stores, ordered by the wait): from L2
    at_x = arena + gl.load(base + C_X) + idx
    out = arena.to(gl.pointer_type(gl.bfloat16), bitcast=True) + 2 * gl.load(base + C_OUT).to(gl.int64) + idx
    parts = 0
    if SK:
        parts = gl.load(base + C_PARTS)
    part = arena + gl.load(base + C_PART) + idx
    pstride = gl.load(base + C_PSTRIDE)
    if k <= CB:
        live = idx < k
        nw = gl.load(arena + norm + idx, mask=live & (norm >= 0), other=0.0)   # in flight with x's loads
        xv = _cast_sum(arena, at_x, part, pstride, parts, live, SK)
        if parts > 0:
            gl.store(at_x, xv, mask=live)
        if norm >= 0:
            xv = xv * gl.rsqrt(gl.sum(xv * xv, axis=0) / k + eps) * nw
        gl.store(out, xv.to(gl.bfloat16), mask=live)
    else:
        ss = gl.zeros([CB], gl.float32, layout=L)
        c = 0
        while c < k:
            live = idx < k - c
            xv = _cast_sum(arena, at_x + c, part + c, pstride, parts, live, SK)
            if parts > 0:
                gl.store(at_x + c, xv, mask=live)
            ss += xv * xv
            c += CB
        scale = 1.0
        if norm >= 0:
            scale = gl.rsqrt(gl.sum(ss, axis=0) / k + eps)
        c = 0
        while c < k:
            live = idx < k - c
            # this thread's own stores of the pass before (the same addresses in the same layout)
            xv = gl.load(at_x + c, mask=live, other=0.0, cache_modifier=".cg") * scale
            if norm >= 0:
                xv = xv * gl.load(arena + norm + c + idx, mask=live, other=0.0)
            gl.store(out + c, xv.to(gl.bfloat16), mask=live)
            c += CB


@gluon.jit
def _sample(arena, ints, base, s, CW: gl.constexpr):
    """The SAMPLE kind's body: the token of the largest of the amax pairs (its offset less the
    logits' base, plus its rank's first token with per; of equal ones the lowest) into ints[token]
    and ints[tokens + s]."""
    PL: gl.constexpr = gl.BlockedLayout([SBLK // (32 * CW)], [32], [CW], [0])
    pairs = gl.load(base + S_PAIRS)
    count = gl.load(base + S_COUNT)
    first_of = gl.load(base + S_BASE)
    per = gl.load(base + S_PER)
    shard = gl.load(base + S_SHARD)
    c = gl.arange(0, SBLK, layout=PL)
    best = float("-inf")
    at = 2 ** 30
    c0 = 0
    while c0 < count:
        live = c0 + c < count
        v = gl.load(arena + pairs + 2 * (c0 + c), mask=live, other=float("-inf"), cache_modifier=".cg")
        o = gl.load(arena + pairs + 2 * (c0 + c) + 1, mask=live, other=2.0 ** 30, cache_modifier=".cg").to(gl.int32)
        t = gl.where(live, o - first_of + gl.where(per > 0, (c0 + c) // gl.maximum(per, 1) * shard, 0), 2 ** 30)
        top = gl.max(v, axis=0)
        first = gl.min(gl.where(v == top, t, 2 ** 30), axis=0)
        at = gl.where(top > best, first, gl.where(top == best, gl.minimum(at, first), at))
        best = gl.maximum(best, top)
        c0 += SBLK
    gl.store(ints + gl.load(base + S_TOKEN), at)
    gl.store(ints + gl.load(base + S_TOKENS) + s, at)


@gluon.jit
def small(op, arena, ints, emb, base, xidx, s, counters, err, w0, n0, w1, n1, epoch, failed, cta, i, trace, peers,
           SPIN: gl.constexpr, TRACE: gl.constexpr, CW: gl.constexpr, TP: gl.constexpr, XB: gl.constexpr,
           SK: gl.constexpr, KMAX: gl.constexpr, HD: gl.constexpr):
    """A node with no streamed operand (EMBED, SAMPLE, NOP; ALLREDUCE with TP; CAST with XB): its
    waits, then its body (SK: CAST's merge of split-K partials compiled in)."""
    failed = waits(counters, err, w0, n0, w1, n1, epoch, failed, cta, i, trace, SPIN, TRACE)
    if TRACE:
        gl.store(trace + i * TRACE_WORDS + 2, now())
    if op == OP_EMBED:
        if XB:                # a constexpr branch: a batched kernel's x is no KMAX span (kernel.py)
            _embed_blocks(arena, ints, emb, base, KMAX, CW)
        else:
            _embed(arena, ints, emb, base, xidx)
    if op == OP_SAMPLE:
        _sample(arena, ints, base, s, CW)
    if XB:                    # a constexpr branch: CAST only in a batched kernel
        if op == OP_CAST:
            _cast(arena, base, KMAX, CW, SK, HD)
    if TP:                    # a constexpr branch: no all-reduce body in a one-rank kernel
        if op == OP_ALLREDUCE:
            failed = allreduce(arena, counters, peers, base, epoch, failed, cta, i, err, SPIN, CW)
    return failed
