"""A KV head's context in shares (kinds.ATTN's splits): the tokens each share holds, and how the
shares' partials merge into the head's output (the share that takes the head's last ticket)."""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from warploop.runtime.stream.sync import barrier

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
def take_ticket(arena, counters, ticket, part, out, head0, grp, n_ctx, splits, obfw, CW: gl.constexpr,
                HD: gl.constexpr, GP: gl.constexpr, KVT: gl.constexpr, XB: gl.constexpr):
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
            merge(arena, part, out, head0, grp, live, obfw, CW, HD, GP, XB)
            gl.atomic_xchg(counters + ticket, 0, sem="relaxed", scope="gpu")


@gluon.jit
def merge(arena, part, out, head0, grp, splits, obfw, CW: gl.constexpr, HD: gl.constexpr, GP: gl.constexpr,
          XB: gl.constexpr):
    """A KV head's shares' partials at `part` into its q heads' rows of out (store_out):
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
    if XB:                          # a constexpr branch (a batch-1 kernel's outputs are fp32)
        store_out(arena, out, head0, grp, o, j, d, obfw, XB, HD)
    else:
        gl.store(arena + out + (head0 + j)[:, None] * HD + d[None, :], o, mask=(j < grp)[:, None])


@gluon.jit
def store_out(arena, out, head0, grp, o, j, d, obfw, XB: gl.constexpr, HD: gl.constexpr):
    """A KV head's q heads' output rows o ([GP, HD]; j its rows, d its columns) into out: fp32, or in a
    batched kernel (XB) whose node's obf word (at obfw) is set, bf16 from element 2 * out (kinds.ATTN)."""
    at = (head0 + j)[:, None] * HD + d[None, :]
    if XB:
        if gl.load(obfw) != 0:
            gl.store(arena.to(gl.pointer_type(gl.bfloat16), bitcast=True) + 2 * out + at, o.to(gl.bfloat16),
                     mask=(j < grp)[:, None])
        else:
            gl.store(arena + out + at, o, mask=(j < grp)[:, None])
    else:
        gl.store(arena + out + at, o, mask=(j < grp)[:, None])
