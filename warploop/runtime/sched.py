"""Device-side scheduler: task slots, the ready ring, inline stacks, completion and errors.

Triton device functions over the arena (layout.py). Everything here runs unchanged on the GPU,
inside the resident kernel, and on the CPU, through the Triton interpreter (cpu.py), which is
what makes the CPU executor a faithful reference.

Task slots: the shared pool (P slots), then R reserved slots per worker, then the front's. A
handle is `s + k * slots` for slot s (so `handle % slots` names the slot and the handles a slot
holds only grow); `done[s]` and `issued[s]` hold the last handle completed and issued there, so
"h is complete" is `done[h % slots] >= h` for as long as anyone can hold h, and a slot is free
when the two are equal. Ready ids travel through an MPMC ring of int64 entries (0: empty, else
id + 1); a task spawned into a full pool goes onto its spawner's own inline stack instead
(docs/runtime.md, "Dynamic work at any size").

Every spin checks the stop word, so an abort from the host ends every wait.

The primitives these are built from (shared reads, acquires, control words, the counter wait)
are in sync.py.
"""
import triton
import triton.language as tl

from warploop.runtime import errors as E
from warploop.runtime import layout as L
from warploop.runtime.sync import (
    ABORT,
    COMPLETION_WORDS,
    CTL,
    CTX_BASE,
    CTX_WORDS,
    HOST_SUBMIT,
    LINE,
    NO_STAMPS,
    SLOT_WORDS,
    acquire,
    clock,
    clock_after,
    ctl,
    host_block,
    i64,
    meta32,
    meta64,
    p64,
    stamping,
    stamps,
    stopped,
    uload,
    uload_ctl2,
)


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
def never_issued(arena, handle):
    """True for a handle no task was ever given (negative, or past its slot's last issued one)."""
    slot = tl.maximum(handle, 0) % tl.load(arena + L.H_POOL)
    return (handle < 0) | (handle > uload(meta64(arena, L.M_ISSUED, slot)))


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
        release_reserved(arena, slot, pool)
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
def release_reserved(arena, slot, slots):
    """A worker's reserved slot is free again (done is published): push it on its owner's free list."""
    reserve = tl.load(arena + L.H_RESERVE)
    owner = (slot - tl.load(arena + L.H_SHARED)) // reserve
    if (slot >= tl.load(arena + L.H_SHARED)) & (owner < tl.load(arena + L.H_WORKERS)):
        head_p = p64(arena + CTX_BASE + owner * CTX_WORDS + L.X_FREE)
        old = acquire(head_p)      # one value for every warp: they all follow the CAS loop together
        going = True
        while going:
            tl.store(meta64(arena, L.M_THEN_NEXT, slot), old)
            tl.debug_barrier()
            seen = tl.atomic_cas(head_p, old, i64(slot), sem="acq_rel")
            going = seen != old
            old = seen


@triton.jit
def attach(arena, handle, cont, worker):
    """Run task `cont` once `handle` completes: link it on the handle's list, or push it now."""
    pool = tl.load(arena + L.H_POOL)
    if never_issued(arena, handle):
        if handle >= 0:
            report_error(arena, E.ERR_BAD_HANDLE, 0, worker, 0, handle, 0)
        push(arena, cont)
    else:
        slot = handle % pool
        linked = False
        while not linked:
            # The list head first, then done: if done still says "not complete", the slot was not
            # reused before the head was read, so `old` is the head of h's own list, and the CAS
            # succeeds only if it still is (list heads never repeat: ids are unique, markers encode h).
            old = acquire(meta64(arena, L.M_THEN_HEAD, slot))
            done = uload(meta64(arena, L.M_DONE, slot)) >= handle
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
