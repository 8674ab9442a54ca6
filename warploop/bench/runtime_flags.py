"""Per-tile flags: the MLP stack's GEMV boundary without the graph's shared counters.

With graph edges, each of a GEMV's 256 tiles signals one counter per layer (256 release atomics on
one address, serialised in one L2 slice) and every consumer's thread 0 polls that address. Here the
graph has no edges: tile t of GEMV g stores its own int32 flag, flags[g, t], with a plain release
store (no atomic, no shared address), and a consumer's threads poll the previous GEMV's 256 flags
in parallel (1 KB, 8 lines, two flags per thread) and meet in one reduction.

Flag values count runs: tile t's flag holds r - 1 when run r starts (only that tile writes it, and
the run boundary orders the writes), so run r waits for the previous GEMV's flags >= r and then
stores r. No reset between replays. The first GEMV of a run waits for nothing (the run boundary).

Measured on an H200 (BENCHMARKS.md, Runtime, round 3): 10% slower than the counters. Every waiter
pays 256 acquires (each with an L1 invalidation) per poll round, more than the atomics it saves.
"""
import triton
import triton.language as tl

from warploop.runtime import layout as L
from warploop.runtime.sync import ABORT, ctl, uload

# Every thread loads its flags with acquire; the reduction after it is a CTA barrier, so every
# warp's later loads (x) are ordered after the acquire (as in sync.POLL_ONE_THREAD).
LD_ACQUIRE = tl.constexpr("ld.acquire.gpu.global.b32 $0, [$1];")
# Thread 0 only: the other threads' stores reach it through the barrier before this.
ST_RELEASE_T0 = tl.constexpr("""{
.reg .pred %pr;
.reg .b32 %tr;
mov.u32 %tr, %tid.x;
setp.eq.u32 %pr, %tr, 0;
@%pr st.release.gpu.global.b32 [$1], $2;
mov.u32 $0, 0;
}""")
NEVER32 = tl.constexpr(-(2**31) + 7)     # a value no flag holds


@triton.jit
def _pending(p, stop, target, BACKEND: tl.constexpr):
    """True (the same for every thread) while some flag at p is below target and the runtime runs."""
    if BACKEND == "cuda":
        f = tl.inline_asm_elementwise(LD_ACQUIRE, "=r,l", [p], dtype=tl.int32, is_pure=False, pack=1)
    else:
        f = tl.load(p, volatile=True)
    # Each thread reads the stop word itself; a thread that saw the abort stops asking, so the
    # reduced answer turns False once every thread has seen it (it only ever grows).
    live = tl.load(stop, volatile=True) < ABORT
    return tl.max(((f < target) & live).to(tl.int32), axis=0) > 0


@triton.jit
def wait_flags(arena, flags, tile, TILES: tl.constexpr, BACKEND: tl.constexpr):
    """Wait until the previous GEMV's TILES flags (the row before `flags`) reach this run's number."""
    target = uload(flags + tile) + 1
    p = flags - TILES + tl.arange(0, TILES)
    stop = ctl(arena, L.C_STOP)
    go = _pending(p, stop, target, BACKEND)
    while go:
        go = _pending(p, stop, target, BACKEND)
    if BACKEND != "cuda":
        # The polls above are volatile, not acquires: one acquiring atomic that writes nothing.
        tl.atomic_cas(flags - TILES, NEVER32, NEVER32, sem="acquire")
        tl.debug_barrier()


@triton.jit
def signal_flag(flags, tile, BACKEND: tl.constexpr):
    """Publish this tile's outputs: flags[tile] += 1, a release store by thread 0 (one writer)."""
    value = tl.load(flags + tile, volatile=True) + 1
    tl.debug_barrier()      # every warp's output stores (and its read of the flag) before the release
    if BACKEND == "cuda":
        tl.inline_asm_elementwise(ST_RELEASE_T0, "=r,l,r", [flags + tile, value], dtype=tl.int32,
                                  is_pure=False, pack=1)
    else:
        tl.atomic_xchg(flags + tile, value, sem="release")


# -- group counters: the boundary with 16 counters per GEMV instead of one or 256 ------------------
GROUPS = tl.constexpr(16)
GROUP_WORDS = tl.constexpr(32)      # one counter per 128-byte line


@triton.jit
def wait_groups(arena, row, tile, TILES: tl.constexpr, BACKEND: tl.constexpr):
    """Tile `tile` of a GEMV whose group counters are `row` (GROUPS lines of int32): wait until every
    group counter of the previous GEMV (the row before) holds this run's count, TILES / GROUPS per run.

    The run number comes from this tile's own group counter, which holds between (r - 1) * n and
    (r - 1) * n + n - 1 when run r reaches this tile (n = TILES / GROUPS; this tile has not signalled).
    """
    n: tl.constexpr = TILES // GROUPS
    target = (uload(row + (tile // n) * GROUP_WORDS) // n + 1) * n
    p = row - GROUPS * GROUP_WORDS + tl.arange(0, GROUPS) * GROUP_WORDS
    stop = ctl(arena, L.C_STOP)
    go = _pending(p, stop, target, BACKEND)
    while go:
        go = _pending(p, stop, target, BACKEND)
    if BACKEND != "cuda":
        # The polls above are volatile, not acquires: one acquiring atomic that writes nothing.
        tl.atomic_cas(row - GROUPS * GROUP_WORDS, NEVER32, NEVER32, sem="acquire")
        tl.debug_barrier()


@triton.jit
def signal_group(row, tile, TILES: tl.constexpr):
    """Count this tile into its group counter: a barrier (every warp's output stores), then one
    release atomic (Triton issues a scalar atomic from one thread)."""
    tl.debug_barrier()
    tl.atomic_add(row + (tile // (TILES // GROUPS)) * GROUP_WORDS, 1, sem="release")
