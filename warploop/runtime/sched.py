"""Device-side scheduler: the task pool, the ready ring, completion and the host bridge ("front").

Triton device functions over the arena (layout.py). Everything here runs unchanged on the GPU,
inside the resident kernel, and on the CPU, through the Triton interpreter (cpu.py), which is
what makes the CPU executor a faithful reference.

Dynamic tasks live in a pool of P slots. Task ids grow by one per task and id % P names the
slot; `done[slot]` holds the last id that completed there, so `done[id % P] >= id` means "id is
complete" for as long as anyone can hold the handle, and a slot is free for id once it reads
id - P. Ready ids travel through an MPMC ring of int64 entries (0: empty, else id + 1).

Every spin checks the stop word, so an abort from the host ends every wait.

Branches on shared words use `uload`, never a plain load: each warp of a program loads on its
own and may see a different value, and warps that take different branches deadlock in the
barriers Triton puts inside scalar atomics.
"""
import triton
import triton.language as tl

from warploop.runtime import descriptor as D
from warploop.runtime import errors as E
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
def uload_ctl4(arena, i0: tl.constexpr, i1: tl.constexpr, i2: tl.constexpr, i3: tl.constexpr):
    """uload of the control words i0..i3 in one round trip (four uloads would take four)."""
    k = tl.arange(0, 4)
    index = tl.where(k == 0, i0, tl.where(k == 1, i1, tl.where(k == 2, i2, i3)))
    rep = tl.zeros([UNIFORM, 1], tl.int32)
    m = tl.max(tl.load(p64(arena + CTL + LINE * (index[None, :] + rep)), volatile=True), axis=0)
    return _pick(m, k, 0), _pick(m, k, 1), _pick(m, k, 2), _pick(m, k, 3)


@triton.jit
def uload_ctl2(arena, i0: tl.constexpr, i1: tl.constexpr):
    """uload of the control words i0 and i1 in one round trip."""
    k = tl.arange(0, 2)
    rep = tl.zeros([UNIFORM, 1], tl.int32)
    m = tl.max(tl.load(p64(arena + CTL + LINE * (tl.where(k == 0, i0, i1)[None, :] + rep)), volatile=True), axis=0)
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
def idle_pause(BACKEND: tl.constexpr):
    """An idle worker's pause between polls, so thousands of pollers do not saturate L2 lines."""
    if BACKEND == "cuda":
        tl.inline_asm_elementwise("nanosleep.u32 100; mov.u32 $0, 0;", "=r", [], dtype=tl.int32,
                                  is_pure=False, pack=1)


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
def report_error(arena, code, opcode, worker, detail, task, fatal):
    """Record the first error (device arena and host block); a fatal one also aborts the runtime."""
    e = arena + CTL + LINE * L.C_ERROR
    if tl.atomic_cas(e + L.E_CODE, 0, code, sem="acq_rel") == 0:
        host = host_block(arena) + L.HB_ERROR
        tl.store(host + L.E_OPCODE, opcode)
        tl.store(host + L.E_WORKER, worker)
        tl.store(host + L.E_DETAIL, detail)
        tl.store(p64(host + L.E_TASK), i64(task))
        tl.store(host + L.E_FATAL, fatal)
        tl.debug_barrier()
        tl.atomic_xchg(host + L.E_CODE, code, sem="release", scope="sys")
    if fatal != 0:
        tl.atomic_xchg(ctl(arena, L.C_STOP), i64(ABORT), sem="release")


@triton.jit
def alloc_task(arena, parent, ticket, worker):
    """Take the next task id and initialise its slot; -1 (and a fatal error) if the pool is full."""
    pool = tl.load(arena + L.H_POOL)
    tid = tl.atomic_add(ctl(arena, L.C_NEXT_ID), i64(1), sem="relaxed")
    slot = tid % pool
    if uload(meta64(arena, L.M_DONE, slot)) != tid - pool:
        report_error(arena, E.ERR_POOL_FULL, 0, worker, pool, tid, 1)
        tid = i64(-1)
    else:
        tl.store(meta64(arena, L.M_PARENT, slot), parent)
        tl.store(meta64(arena, L.M_THEN_HEAD, slot), -2 * tid - 2)   # "empty list of tid"
        tl.store(meta64(arena, L.M_RESULT, slot), i64(0))
        tl.store(meta64(arena, L.M_HOST_TICKET, slot), ticket)
        tl.store(meta32(arena, L.M_PENDING, slot), 1)
        tl.store(meta32(arena, L.M_STATUS, slot), 0)
        if parent >= 0:
            # The parent completes only after this child does (structured completion).
            tl.atomic_add(meta32(arena, L.M_PENDING, parent % pool), 1, sem="relaxed")
    return tid


@triton.jit
def write_header(d, opcode):
    """Descriptor words 0-7 of a dynamic task: opcode, no node, no params, no signal, no waits."""
    k = tl.arange(0, 8)
    words = tl.where(k == 0, opcode, tl.where((k == 2) | (k == 5) | (k == 7), 0, -1))
    tl.store(d + k, words)


@triton.jit
def push(arena, tid):
    """Publish a ready task id. The ring is as large as the pool, so a slot frees promptly."""
    ring = p64(arena + tl.load(arena + L.H_RING_OFF))
    size = tl.load(arena + L.H_RING)
    tl.debug_barrier()
    t = tl.atomic_add(ctl(arena, L.C_RING_TAIL), i64(1), sem="relaxed")
    entry = ring + t % size
    go = tl.atomic_cas(entry, i64(0), tid + 1, sem="release") != 0
    while go:
        go = (tl.atomic_cas(entry, i64(0), tid + 1, sem="release") != 0) & (not stopped(arena))


@triton.jit
def try_pop(arena, BACKEND: tl.constexpr = NO_STAMPS):
    """Claim one ready task id, or -1 when the ring is empty. With BACKEND, a pop is stamped."""
    if BACKEND == "cuda":
        on = stamping(arena)
    head_p = ctl(arena, L.C_RING_HEAD)
    head, tail = uload_ctl2(arena, L.C_RING_HEAD, L.C_RING_TAIL)
    tid = i64(-1)
    if head < tail:
        if tl.atomic_cas(head_p, head, head + 1, sem="relaxed") == head:
            ring = p64(arena + tl.load(arena + L.H_RING_OFF))
            entry = ring + head % tl.load(arena + L.H_RING)
            v = tl.atomic_xchg(entry, i64(0), sem="acquire")
            go = (v == 0) & (not stopped(arena))   # its producer took the ticket, is still writing
            while go:
                v = tl.atomic_xchg(entry, i64(0), sem="acquire")
                go = (v == 0) & (not stopped(arena))
            tid = v - 1
            if BACKEND == "cuda":
                tl.store(stamps(arena) + L.ST_POPPED, clock_after(v, BACKEND), mask=on)
    return tid


@triton.jit
def notify_host(arena, ticket, slot, BACKEND: tl.constexpr = NO_STAMPS):
    """Write the completion record of a host-submitted task into the host block."""
    if BACKEND == "cuda":
        on = stamping(arena)
        t0 = clock(BACKEND)
    host = host_block(arena)
    nslots = tl.load(arena + L.H_SUBMIT)
    rec = p64(host + HOST_SUBMIT + nslots * SLOT_WORDS + (ticket % nslots) * COMPLETION_WORDS)
    status = tl.load(meta32(arena, L.M_STATUS, slot), volatile=True).to(tl.int64)
    result = tl.load(meta64(arena, L.M_RESULT, slot), volatile=True)
    # Three self-checking words (layout.py): each carries the sequence in its low half, so no
    # write has to wait for another. The first is a system-scope release, so everything the task
    # wrote is visible before the record is whole; its fence has no host writes of ours to flush.
    seq = (ticket + 1) & 0xFFFFFFFF
    tl.debug_barrier()
    old = tl.atomic_xchg(rec, seq | (status << 32), sem="release", scope="sys")
    tl.atomic_xchg(rec + 1, seq | (result << 32), sem="relaxed", scope="sys")
    tl.atomic_xchg(rec + 2, seq | ((result >> 32) << 32), sem="relaxed", scope="sys")
    if BACKEND == "cuda":
        st = stamps(arena)
        tl.store(st + L.ST_NOTIFY, t0, mask=on)
        tl.store(st + L.ST_NOTIFIED, clock_after(old, BACKEND), mask=on)
        tl.store(st + L.ST_DONE_TICKET, ticket, mask=on)


@triton.jit
def complete(arena, tid, status, BACKEND: tl.constexpr = NO_STAMPS):
    """The body of task `tid` returned: finish it, and its ancestors whose last child it was.

    Finishing a task enqueues its continuations, tells the host if it was submitted from there,
    publishes done[slot] (freeing the slot) and passes its status up to the parent.
    """
    if BACKEND == "cuda":
        on = stamping(arena)
        body_done = clock(BACKEND)
    pool = tl.load(arena + L.H_POOL)
    slot = tid % pool
    if status != 0:
        tl.atomic_cas(meta32(arena, L.M_STATUS, slot), 0, status, sem="relaxed")
    tl.debug_barrier()
    cur = tid
    going = tl.atomic_add(meta32(arena, L.M_PENDING, slot), -1, sem="acq_rel") == 1
    while going:
        slot = cur % pool
        parent = tl.load(meta64(arena, L.M_PARENT, slot), volatile=True)
        mine = tl.load(meta32(arena, L.M_STATUS, slot), volatile=True)
        waiting = tl.atomic_xchg(meta64(arena, L.M_THEN_HEAD, slot), -2 * cur - 3, sem="acq_rel")
        while waiting >= 0:
            after = tl.load(meta64(arena, L.M_THEN_NEXT, waiting % pool), volatile=True)
            push(arena, waiting)
            waiting = after
        ticket = tl.load(meta64(arena, L.M_HOST_TICKET, slot), volatile=True)
        if ticket >= 0:
            notify_host(arena, ticket, slot, BACKEND)
        tl.atomic_xchg(meta64(arena, L.M_DONE, slot), cur, sem="release")
        tl.atomic_add(ctl(arena, L.C_COMPLETED), i64(1), sem="release")
        going = False
        if parent >= 0:
            pslot = parent % pool
            if mine != 0:
                tl.atomic_cas(meta32(arena, L.M_STATUS, pslot), 0, mine, sem="relaxed")
            going = tl.atomic_add(meta32(arena, L.M_PENDING, pslot), -1, sem="acq_rel") == 1
        cur = parent
    if BACKEND == "cuda":
        tl.store(stamps(arena) + L.ST_BODY_DONE, body_done, mask=on)


@triton.jit
def attach(arena, handle, cont, worker):
    """Run task `cont` once `handle` completes: link it on the handle's list, or push it now."""
    pool = tl.load(arena + L.H_POOL)
    issued = uload(ctl(arena, L.C_NEXT_ID))
    if (handle < 0) | (handle >= issued):
        if handle >= issued:
            report_error(arena, E.ERR_BAD_HANDLE, 0, worker, 0, handle, 0)
        push(arena, cont)
    else:
        slot = handle % pool
        linked = False
        while not linked:
            done = uload(meta64(arena, L.M_DONE, slot)) >= handle
            old = acquire(meta64(arena, L.M_THEN_HEAD, slot))
            if done | (old == -2 * handle - 3):
                push(arena, cont)
                linked = True
            else:
                tl.store(meta64(arena, L.M_THEN_NEXT, cont % pool), old)
                tl.debug_barrier()
                linked = tl.atomic_cas(meta64(arena, L.M_THEN_HEAD, slot), old, cont, sem="acq_rel") == old


@triton.jit
def write_trace(arena, ctx, worker, t0, t1, opcode, ident):
    """Append one event to this worker's trace ring (start, end, opcode, worker, id)."""
    cap = tl.load(arena + L.H_TRACE_CAP)
    base = tl.load(p64(arena + L.H_TRACE_ADDR)).to(tl.pointer_type(tl.int32))
    n = tl.load(ctx + L.X_TRACE, volatile=True)
    ev = base + (worker * cap + n % cap) * L.TRACE_WORDS
    tl.store(p64(ev), t0)
    tl.store(p64(ev + 2), t1)
    tl.store(ev + 4, opcode)
    tl.store(ev + 5, worker)
    tl.store(p64(ev + 6), i64(ident))
    tl.store(ctx + L.X_TRACE, n + 1)


@triton.jit
def stage_waits(ctx, c0, t0, c1, t1):
    """For bodies that wait themselves (waits=True): leave the waits where wl.wait(ctx) finds them."""
    tl.store(ctx + L.X_WAIT, c0)
    tl.store(ctx + L.X_WAIT + 1, c1)
    tl.store(p64(ctx + L.X_WAIT_TARGET), t0)
    tl.store(p64(ctx + L.X_WAIT_TARGET) + 1, t1)
    tl.debug_barrier()      # thread 0 stored these; every warp of the body reads them
