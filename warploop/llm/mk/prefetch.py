"""Weights into L2 ahead of the GEMV tiles that read them (graph option `l2_ahead_kb`).

A stage of GEMV tiles streams in step: every worker issues its tile, the bytes arrive at one
rate, then every worker spends the gap between tiles (reductions, stores, the next dispatch, the
wait for the stage before) while memory idles (docs/megakernel.md, "What limits batch 1"). Weights
depend on nothing, so a tile can ask for later tiles' weights before it waits: the last round of
a stage's tiles prefetches into L2 the first `l2_ahead_kb` KB of the weights that follow it
(stage_words), so they stream in while the stages between (the attention chain after qkv)
wait on the memory system's latency rather than its bandwidth, and the later tiles read L2.

The request travels in one int64 argument of the GEMV task (its `kp` slot: on a GPU plan the widths
are constexprs, so the run-time width is not needed there), encoded as a word:

    bits 0-47   the first byte's address
    bits 48-61  the length in 256-byte units (at most 4 MB)
    bit 62      a gate_up footprint: the same length again at UPB bytes further (the up rows)

0 asks for nothing. On CUDA each thread issues `prefetch.global.L2` for its share of the 128-byte
lines (any compute capability; no registers wait on it); elsewhere the word is ignored.
"""
from __future__ import annotations

import triton
import triton.language as tl

ADDR_BITS = tl.constexpr(48)
UNIT = tl.constexpr(256)
SIZE_BITS = tl.constexpr(14)
TWO_BIT = tl.constexpr(62)
LINE = tl.constexpr(128)      # bytes a thread's prefetch covers
LANES = tl.constexpr(128)     # lines a pass covers (one per thread of a 4-warp worker)


def encode(addr: int, nbytes: int, two: bool = False) -> int:
    """The word asking for [addr, addr + nbytes) (and, with `two`, the same at UPB further). The
    length is rounded up to whole units and capped at the field's 4 MB: a prefetch is a hint."""
    bits, unit, size, two_bit = ADDR_BITS.value, UNIT.value, SIZE_BITS.value, TWO_BIT.value
    if addr <= 0 or addr >> bits or nbytes <= 0:
        return 0
    units = min(-(-nbytes // unit), (1 << size) - 1)
    return addr | units << bits | int(bool(two)) << two_bit


def decode(word: int) -> tuple[int, int, bool]:
    """(address, bytes, two) of a word (the host's view of what the device issues)."""
    bits, size = ADDR_BITS.value, SIZE_BITS.value
    return word & ((1 << bits) - 1), (word >> bits & ((1 << size) - 1)) * UNIT.value, bool(word >> TWO_BIT.value & 1)


def runs(footprints: list[tuple[int, int, bool]]) -> list[list[int]]:
    """Indices of footprints grouped into runs of contiguous memory: each one starts where the one
    before ends, with the same two-range flag (a GEMV's consecutive tiles)."""
    out: list[list[int]] = []
    for i, (addr, _, two) in enumerate(footprints):
        if out:
            pa, pn, ptwo = footprints[out[-1][-1]]
            if pa + pn == addr and ptwo == two:
                out[-1].append(i)
                continue
        out.append([i])
    return out


def stage_words(stages: list[list[tuple[int, int, bool]]], ahead_bytes: int, prefetching: list[bool],
                workers: int) -> list[list[int]]:
    """Words per node of each GEMV stage (its footprints, in the order the graph runs them): the last
    round (`workers` nodes) of each stage with `prefetching` set asks L2 for the first `ahead_bytes`
    of weights after the stage, split over its nodes as contiguous ranges; every other node asks for
    nothing. So the weights of the next stages stream in while the stage's dependents wait on it
    (the attention chain after qkv: rope, attention, combine, which read almost no memory)."""
    words = [[0] * len(st) for st in stages]
    for s, stage in enumerate(stages):
        if not prefetching[s] or not stage or ahead_bytes <= 0:
            continue
        targets: list[tuple[int, int, bool]] = []
        got = 0
        for later in stages[s + 1:]:
            for fp in later:
                if got >= ahead_bytes:
                    break
                targets.append(fp)
                got += fp[1] * (2 if fp[2] else 1)
        if not targets:
            continue
        prefetchers = list(range(max(0, len(stage) - workers), len(stage)))
        groups = runs(targets)[:len(prefetchers)]
        total = sum(sum(targets[i][1] for i in g) for g in groups)
        shares = [max(1, len(prefetchers) * sum(targets[i][1] for i in g) // total) for g in groups]
        while sum(shares) > len(prefetchers):
            shares[shares.index(max(shares))] -= 1
        slot = 0
        for g, share in zip(groups, shares, strict=True):
            for c in range(share):
                chunk = g[c * len(g) // share:(c + 1) * len(g) // share]
                if chunk:
                    addr, _, two = targets[chunk[0]]
                    words[s][prefetchers[slot]] = encode(addr, sum(targets[i][1] for i in chunk), two)
                slot += 1
    return words


@triton.jit
def _issue(addr):
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [addr], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def l2_prefetch(word, UPB: tl.constexpr, BACKEND: tl.constexpr):
    """Issue the word's prefetch (module docstring); returns at once, nothing waits on it."""
    if BACKEND == "cuda":
        if word != 0:
            base = word & ((1 << ADDR_BITS) - 1)
            n = ((word >> ADDR_BITS) & ((1 << SIZE_BITS) - 1)) * UNIT
            two = ((word >> TWO_BIT) & 1) != 0
            lanes = tl.arange(0, LANES).to(tl.int64) * LINE
            for s in range(0, n, LANES * LINE):
                off = tl.minimum(s + lanes, n - LINE)       # a short tail repeats its last line
                _issue(base + off)
                if two:
                    _issue(base + UPB + off)
