"""Device-side primitives over the arena that every part of the resident kernel shares.

Constants from the layouts (as Triton constexprs), reads of shared words that every thread agrees
on (`uload` and its one-round-trip forms), acquires, the control words, clocks and the submit
stamps, an idle worker's pause, and the counter wait (`wait_ge`). The scheduler (sched.py), the
worker loop (worker.py), the front (front.py) and task-side calls (device.py) are built from these.
Everything runs unchanged on the GPU and, through the Triton interpreter, on the CPU.

Branches on shared words use `uload`, never a plain load: each warp of a program loads on its
own and may see a different value, and warps that take different branches deadlock in the
barriers Triton puts inside scalar atomics.
"""
import triton
import triton.language as tl

from warploop.runtime import descriptor as D
from warploop.runtime import layout as L

DESC_WORDS = tl.constexpr(D.DESC_WORDS)
ARG_WORD = tl.constexpr(D.ARG_WORD)
MAX_PARAMS = tl.constexpr(L.MAX_PARAMS)
LINE = tl.constexpr(L.LINE)
CTL = tl.constexpr(L.HEADER_WORDS)
CTX_BASE = tl.constexpr(L.CTX_BASE)
CTX_WORDS = tl.constexpr(L.CTX_WORDS)
ABORT = tl.constexpr(L.ABORT)
DRAIN = tl.constexpr(L.DRAIN)
RUN = tl.constexpr(L.RUN)
PARK = tl.constexpr(L.PARK)
GRAPH_WORDS = tl.constexpr(L.GRAPH_WORDS)
GREQ_SLOTS = tl.constexpr(L.GREQ_SLOTS)
GREQ_WORDS = tl.constexpr(L.GREQ_WORDS)
SLOT_WORDS = tl.constexpr(L.SUBMIT_SLOT_WORDS)
SLOT_DESC = tl.constexpr(L.SLOT_DESC)
COMPLETION_WORDS = tl.constexpr(L.COMPLETION_WORDS)
HOST_GREQ = tl.constexpr(L.HostLayout().greq)
HOST_SUBMIT = tl.constexpr(L.HostLayout().submit)
UNIFORM = tl.constexpr(128)
NEVER = tl.constexpr(-(2**62) - 7)   # a value no int64 control word ever holds
NO_STAMPS = tl.constexpr("none")     # the BACKEND default of functions that stamp (try_pop, complete)


@triton.jit
def p64(p):
    """View an int32 pointer as an int64 pointer (the address must be 8-byte aligned)."""
    return p.to(tl.pointer_type(tl.int64), bitcast=True)


@triton.jit
def uload(p):
    """Read a shared word so that every thread of the program agrees on the value.

    All threads load, then take the maximum (a reduction through shared memory): every word read
    this way only ever grows, so the maximum is a value that really was there, and the newest.
    """
    return tl.max(tl.load(p + tl.zeros([UNIFORM], tl.int32), volatile=True), axis=0)


@triton.jit
def _pick(m, k, index: tl.constexpr):
    return tl.sum(tl.where(k == index, m, 0), axis=0)


@triton.jit
def uload3(base, o0, o1, o2):
    """uload of base[o0], base[o1], base[o2] in one round trip: all loads are issued together
    (three uloads would each wait for the last, which costs three bus round trips on host memory).

    Only the thread holding row 0 loads (three bus reads a round, not 3 x 128); the reduction hands
    its values to every thread. Measured on an H200: one program reading pinned host memory with
    all its threads slowed an HBM-bound kernel beside it by 12% (BENCHMARKS.md, Runtime).
    """
    k = tl.arange(0, 4)
    offs = tl.where(k == 0, o0, tl.where(k == 1, o1, o2))
    row = tl.arange(0, UNIFORM)[:, None]
    block = tl.load(base + (offs[None, :] + row * 0), mask=(k < 3)[None, :] & (row == 0), other=-(2**31),
                    volatile=True)
    m = tl.max(block, axis=0)
    return _pick(m, k, 0), _pick(m, k, 1), _pick(m, k, 2)


@triton.jit
def _ctl_row(arena, index):
    """The control words `index` (a small vector), the same for every thread: one thread loads them
    (their lines at once) and a reduction hands them to the others; every such word only grows."""
    rows = tl.arange(0, UNIFORM)[:, None]
    block = tl.load(p64(arena + CTL + LINE * (index[None, :] + 0 * rows)), mask=rows == 0, other=-(2**62),
                    volatile=True)
    return tl.max(block, axis=0)


@triton.jit
def uload_ctl4(arena, i0: tl.constexpr, i1: tl.constexpr, i2: tl.constexpr, i3: tl.constexpr):
    """uload of the control words i0..i3 in one round trip (four uloads would take four)."""
    k = tl.arange(0, 4)
    m = _ctl_row(arena, tl.where(k == 0, i0, tl.where(k == 1, i1, tl.where(k == 2, i2, i3))))
    return _pick(m, k, 0), _pick(m, k, 1), _pick(m, k, 2), _pick(m, k, 3)


@triton.jit
def uload_ctl2(arena, i0: tl.constexpr, i1: tl.constexpr):
    """uload of the control words i0 and i1 in one round trip."""
    k = tl.arange(0, 2)
    m = _ctl_row(arena, tl.where(k == 0, i0, i1))
    return _pick(m, k, 0), _pick(m, k, 1)


@triton.jit
def acquire(p):
    """Read the int64 at p with acquire semantics, one value for the whole program.

    A compare-and-swap with a value never stored: it writes nothing, and unlike
    atomic_add(p, 0) (which the compiler folds away, acquire and all) it stays an atomic.
    The barrier orders every warp's later loads after thread 0's acquire.
    """
    v = tl.atomic_cas(p, i64(NEVER), i64(NEVER), sem="acquire")
    tl.debug_barrier()
    return v


@triton.jit
def ctl(arena, index):
    """The int64 control word `index` (layout.C_*), alone on its cache line."""
    return p64(arena + CTL + LINE * index)


@triton.jit
def host_block(arena):
    return tl.load(p64(arena + L.H_HOST_ADDR)).to(tl.pointer_type(tl.int32))


@triton.jit
def meta64(arena, array, slot):
    pool = tl.load(arena + L.H_POOL)
    return p64(arena + tl.load(arena + L.H_POOL_META) + 2 * pool * array) + slot


@triton.jit
def meta32(arena, array, slot):
    pool = tl.load(arena + L.H_POOL)
    return arena + tl.load(arena + L.H_POOL_I32) + pool * array + slot


@triton.jit
def desc_of(arena, slot):
    return arena + tl.load(arena + L.H_POOL_DESC) + slot * DESC_WORDS


@triton.jit
def i64(x):
    return tl.full([], 0, tl.int64) + x


@triton.jit
def stopped(arena):
    return uload(ctl(arena, L.C_STOP)) >= ABORT


@triton.jit
def clock(BACKEND: tl.constexpr):
    """Nanoseconds on the GPU's global timer (0 where the backend has none wired: hip, cpu)."""
    if BACKEND == "cuda":
        t = tl.extra.cuda.globaltimer()
    else:
        t = tl.zeros([], tl.int64)
    return t


@triton.jit
def clock_after(x, BACKEND: tl.constexpr):
    """clock(), read only once `x` has arrived: a plain timer read may issue while a load or atomic
    whose arrival it should time is still in flight (the read is predicated on x)."""
    if BACKEND == "cuda":
        t = tl.inline_asm_elementwise(
            "{ .reg .pred %pz; setp.eq.s64 %pz, $1, -9223372036854775807; @%pz mov.u64 $0, 0; "
            "@!%pz mov.u64 $0, %globaltimer; }", "=l,l", [x.to(tl.int64)], dtype=tl.int64, is_pure=False, pack=1)
    else:
        t = tl.zeros([], tl.int64)
    return t


@triton.jit
def stamps(arena):
    """The submit stamps (layout.STAMP_*): int64 words in the spare part of the C_SUBMIT_HEAD line."""
    return p64(arena + CTL + LINE * L.C_SUBMIT_HEAD + L.STAMP_BASE)


@triton.jit
def stamping(arena):
    """Whether the host turned the submit stamps on (a load to issue early, used only as a mask)."""
    return tl.load(arena + CTL + LINE * L.C_SUBMIT_HEAD + L.STAMP_ON, volatile=True) != 0


@triton.jit
def idle_pause(idle, BACKEND: tl.constexpr):
    """An idle worker's pause between polls: 100 ns after work, doubling with each empty poll up to
    1.6 us, so idle workers neither saturate L2 lines nor take issue slots from kernels beside them."""
    if BACKEND == "cuda":
        ns = 100 << tl.minimum(idle, 4)
        tl.inline_asm_elementwise("nanosleep.u32 $1; mov.u32 $0, 0;", "=r,r", [ns], dtype=tl.int32,
                                  is_pure=False, pack=1)


@triton.jit
def fence_sys(BACKEND: tl.constexpr):
    """A sequentially consistent system-scope fence: a store before it is visible to the host before
    any load after it is performed (the store-load order a Dekker handshake needs)."""
    if BACKEND == "cuda":
        tl.inline_asm_elementwise("fence.sc.sys; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


# Thread 0 spins on the counter with ld.acquire (one poller per program, not one per warp), then
# every thread meets it at a barrier: the barrier orders the other threads' later loads after the
# acquire. `barrier.sync` (not `bar.sync`, which is `.aligned`) because thread 0 diverges from its
# warp. The stop word is read in the loop, so an abort ends the wait; it is issued before the
# acquire (later loads may not pass an acquire), so each round is one round trip, not two.
# Labels are local to `{ }`, so the block can be inlined many times.
POLL_ONE_THREAD = tl.constexpr("""{
.reg .pred %pw, %pd;
.reg .b32 %tw;
.reg .b64 %sw;
mov.u32 %tw, %tid.x;
mov.b64 $0, 0;
setp.ne.u32 %pw, %tw, 0;
@%pw bra WL_MEET;
WL_POLL:
ld.relaxed.gpu.global.b64 %sw, [$3];
ld.acquire.gpu.global.b64 $0, [$1];
setp.ge.s64 %pd, $0, $2;
@%pd bra WL_MEET;
setp.ge.s64 %pd, %sw, $4;
@%pd bra WL_MEET;
bra WL_POLL;
WL_MEET:
barrier.sync 0;
}""")


@triton.jit
def wait_ge(arena, p, target, BACKEND: tl.constexpr):
    """Spin until *p >= target (acquire) or the runtime is aborted (callers check the stop word)."""
    if BACKEND == "cuda":
        tl.inline_asm_elementwise(POLL_ONE_THREAD, "=l,l,l,l,l", [p, i64(target), ctl(arena, L.C_STOP), i64(ABORT)],
                                  dtype=tl.int64, is_pure=False, pack=1)
    else:
        v = tl.load(p, volatile=True)
        go = (v < target) & (tl.load(ctl(arena, L.C_STOP), volatile=True) < ABORT)
        while go:
            v = tl.load(p, volatile=True)
            go = (v < target) & (tl.load(ctl(arena, L.C_STOP), volatile=True) < ABORT)
        acquire(p)


@triton.jit
def wait_pair(arena, ctx, counters, c0, t0, c1, t1, BACKEND: tl.constexpr):
    """The runtime's wait before a body: counter c >= target for each wait in use. The context words
    (for rt.status()) are written only around a wait that happens."""
    if c0 >= 0:
        tl.store(ctx + L.X_DETAIL, c0)
        tl.store(ctx + L.X_STATE, L.S_WAITING)
        wait_ge(arena, counters + c0, t0, BACKEND)
    if c1 >= 0:
        tl.store(ctx + L.X_DETAIL, c1)
        tl.store(ctx + L.X_STATE, L.S_WAITING)
        wait_ge(arena, counters + c1, t1, BACKEND)
    if (c0 >= 0) | (c1 >= 0):
        tl.store(ctx + L.X_STATE, L.S_RUNNING)
