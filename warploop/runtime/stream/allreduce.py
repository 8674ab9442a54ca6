"""The streaming kernel's all-reduce body (kinds.ALLREDUCE), compiled in with
StreamConfig.tensor_parallel: each rank's kernel runs its own program over its shard, and the ranks'
arenas and counters are in symmetric memory (the executor's `peers`: every rank's arena address, then
every rank's counters address).

A slice's node runs after its waits (this rank's producers of the partial are done), then:
1. bumps counter `meet` in every peer's counters: a release at system scope, cumulative over the
   producers' stores it acquired, so a peer that sees the bump sees this rank's partial;
2. waits, at most SPIN polls (acquire, system scope), for its own `meet` to count every peer's bump
   of this run: (world - 1) a run;
3. sums every rank's partial in rank order, read in place from the peers' arenas over NVLink
   (volatile loads: never a stale cached line), adds out for "add", and stores out: the same bits
   on every rank, as the CPU reference's (reference.run_node).
A rank writes a partial region again only after a later all-reduce, whose bumps the peers send once
they have read it (stream_step keeps two regions a layer for that).
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from warploop.runtime.stream.kinds import ALLREDUCE, EPILOGUES
from warploop.runtime.stream.sync import wait_counter

OP_ALLREDUCE = gl.constexpr(ALLREDUCE.opcode)
A_SRC, A_OUT, A_N = gl.constexpr(ALLREDUCE.word("src")), gl.constexpr(ALLREDUCE.word("out")), \
    gl.constexpr(ALLREDUCE.word("n"))
A_EPI, A_WORLD = gl.constexpr(ALLREDUCE.word("epi")), gl.constexpr(ALLREDUCE.word("world"))
A_RANK, A_MEET = gl.constexpr(ALLREDUCE.word("rank")), gl.constexpr(ALLREDUCE.word("meet"))
A_ADD = gl.constexpr(EPILOGUES["add"])
ABLK = gl.constexpr(1024)       # floats summed per round (program.ALLREDUCE_SLICE: one round a slice)


@gluon.jit
def allreduce(arena, counters, peers, base, epoch, failed, cta, i, err, SPIN: gl.constexpr, CW: gl.constexpr):
    """One all-reduce slice (module docstring); returns `failed` (1 once a wait gave up)."""
    src = gl.load(base + A_SRC)
    out = gl.load(base + A_OUT)
    n = gl.load(base + A_N)
    epi = gl.load(base + A_EPI)
    world = gl.load(base + A_WORLD)
    rank = gl.load(base + A_RANK)
    meet = gl.load(base + A_MEET)
    q = 0
    while q < world:
        if q != rank:
            theirs = gl.load(peers + world + q).to(gl.pointer_type(gl.int32), bitcast=True)
            gl.atomic_add(theirs + meet, 1, sem="release", scope="sys")
        q += 1
    failed = wait_counter(counters, err, meet, (world - 1) * (epoch + 1), failed, cta, i, SPIN, "sys")
    layout: gl.constexpr = gl.BlockedLayout([4], [32], [CW], [0])
    idx = gl.arange(0, ABLK, layout=layout)
    c0 = 0
    while c0 < n:
        live = c0 + idx < n
        acc = gl.zeros([ABLK], gl.float32, layout=layout)
        q = 0
        while q < world:          # rank order, from 0: every rank adds the same way
            part = gl.load(peers + q).to(gl.pointer_type(gl.float32), bitcast=True)
            acc += gl.load(part + src + c0 + idx, mask=live, other=0.0, volatile=True)
            q += 1
        if epi == A_ADD:
            acc += gl.load(arena + out + c0 + idx, mask=live, other=0.0, cache_modifier=".cg")
        gl.store(arena + out + c0 + idx, acc, mask=live)
        c0 += ABLK
    return failed
