"""Task slots: where a new task lives, and where a worker's next task comes from.

Slots are the shared pool (P, `Runtime(pool=...)`), then R reserved slots per worker, then the
front's (one per submit slot). A handle is `s + k * slots` for slot s: `handle % slots` names the
slot, and the handles one slot holds only grow, so "h is complete" stays `done[h % slots] >= h`.

A new task takes a shared slot when one is free. When the pool is full, a worker's spawn takes one
of its own reserved slots and goes on its *inline stack*, a list private to the worker, which it
runs before anything else once the spawning body returns (Triton inlines every task body into one
kernel, so a body cannot run another task itself: no recursion). Nothing here ever waits, so it
adds no way to deadlock; depth-first order keeps a tree's live tasks near workers x depth x
fan-out, which the reserve holds. Only when the reserve is full too does the runtime stop, with
an error naming pool= and the live count. docs/runtime.md has the argument in full.
"""
import triton
import triton.language as tl

from warploop.runtime import errors as E
from warploop.runtime import layout as L
from warploop.runtime.sched import push, report_error, try_pop
from warploop.runtime.sync import CTL, CTX_BASE, CTX_WORDS, LINE, UNIFORM, acquire, ctl, i64, meta32, meta64, p64, uload


@triton.jit
def claim_shared(arena, slots, shared):
    """Draw a task id and claim its shared slot: the handle, or -1 if the slot is busy.

    Id t names shared slot t % P and the handle (t // P) * slots + t % P. A busy slot (a long task,
    the root of a tree, holds it) is not waited for: the caller takes a reserved slot instead, and
    the next id names the next slot. Two drawers of one slot race through the CAS on its issued
    word; one whose handle is older than the slot's last completed one lost it to a later round.
    One try, not a loop: every spawn site inlines this, and a loop here costs compile time.
    """
    t = tl.atomic_add(ctl(arena, L.C_NEXT_ID), i64(1), sem="relaxed")
    slot = t % shared
    handle = (t // shared) * slots + slot
    done = uload(meta64(arena, L.M_DONE, slot))
    got = i64(-1)
    if done < handle:
        if tl.atomic_cas(meta64(arena, L.M_ISSUED, slot), done, handle, sem="relaxed") == done:
            got = handle
    return got


@triton.jit
def claim_free(arena, ctx, slots):
    """Pop a slot off this worker's list of free reserved slots: its next handle, or -1 if none.

    Only the owner pops, and completions anywhere push (sched.release_reserved), so the list's head
    changes under a pop only by pushes, which fail its CAS (no ABA: nobody else can pop and re-push
    the slot in between). Scalar code: every spawn site inlines it.
    """
    head_p = p64(ctx + L.X_FREE)
    got = i64(-1)
    going = True
    while going:
        top = acquire(head_p)
        going = top >= 0
        if going:
            after = tl.load(meta64(arena, L.M_THEN_NEXT, top), volatile=True)
            if tl.atomic_cas(head_p, top, after, sem="acq_rel") == top:
                # Only this worker writes a reserved slot's issued word, so every thread reads the same.
                got = tl.load(meta64(arena, L.M_ISSUED, top), volatile=True) + slots
                tl.store(meta64(arena, L.M_ISSUED, top), got)
                going = False
    return got


@triton.jit
def claim_front(arena, slots, ticket):
    """The front's slot for host submission `ticket`: reserved slot ticket % S of the front's S, its
    next handle, or -1 while its last task has not published done yet.

    The host posts ticket t only after collecting ticket t - S's completion record, which the
    device writes just before it publishes done, so the slot is free or about to be: a busy one
    leaves the submission in the ring for the next round. Only the front claims these slots, so
    no CAS, and no id to wait for: one round trip, where a shared slot costs three.
    """
    shared = tl.load(arena + L.H_SHARED)
    count = tl.load(arena + L.H_FRONT_RESERVE)
    slot = shared + tl.load(arena + L.H_WORKERS) * tl.load(arena + L.H_RESERVE) + ticket % count
    # Both words in one round trip, loaded by one thread and handed to the others by a reduction,
    # so every warp takes the same branch (sync.uload's rule).
    k = tl.arange(0, 2)
    rows = tl.arange(0, UNIFORM)[:, None]
    offs = (k * (L.M_ISSUED - L.M_DONE) * slots)[None, :] + 0 * rows
    words = tl.max(tl.load(meta64(arena, L.M_DONE, slot) + offs, mask=rows == 0, other=-(2**62), volatile=True),
                   axis=0)
    done = tl.sum(tl.where(k == 0, words, 0), axis=0)
    issued = tl.sum(tl.where(k == 1, words, 0), axis=0)
    got = i64(-1)
    if done == issued:
        got = issued + slots
        tl.store(meta64(arena, L.M_ISSUED, slot), got)
    return got


@triton.jit
def alloc_task(arena, parent, ticket, worker):
    """Take a free slot for a new task and initialise it: (handle, reserved), handle -1 if none.

    A worker takes a shared slot if its id's is free, else one of its reserved slots, and the task
    is `reserved`: a spawn runs it on this worker, after the current body (device.spawn). With the
    reserve full too, it reports the fatal ERR_POOL_FULL (with the live count). The front (worker
    -1) takes the slot of its submit ticket (claim_front), or gets -1 and retries next round.
    """
    slots = tl.load(arena + L.H_POOL)
    shared = tl.load(arena + L.H_SHARED)
    if worker < 0:      # the front: host submissions have slots of their own
        tid = claim_front(arena, slots, ticket)
        reserved = tid >= 0
        if reserved:      # counted (live = drawn - completed) without waiting for the reply
            tl.atomic_add(ctl(arena, L.C_NEXT_ID), i64(1), sem="relaxed")
    else:
        tid = claim_shared(arena, slots, shared)
        reserved = tid < 0
        if reserved:      # the id drawn counts this task unless no reserved slot is free either
            tid = claim_free(arena, arena + CTX_BASE + worker * CTX_WORDS, slots)
            if tid < 0:
                tl.atomic_add(ctl(arena, L.C_COMPLETED), i64(1), sem="relaxed")
    if tid < 0:
        if worker >= 0:
            # For the message only (thread 0 stores it), so plain loads: no reduction in every spawn.
            live = tl.load(ctl(arena, L.C_NEXT_ID), volatile=True) - tl.load(ctl(arena, L.C_COMPLETED), volatile=True)
            report_error(arena, E.ERR_POOL_FULL, 0, worker, shared, live, 1)
    else:
        slot = tid % slots
        tl.store(meta64(arena, L.M_PARENT, slot), parent)
        tl.store(meta64(arena, L.M_THEN_HEAD, slot), -2 * tid - 2)   # "empty list of tid"
        tl.store(meta64(arena, L.M_RESULT, slot), i64(0))
        tl.store(meta64(arena, L.M_HOST_TICKET, slot), ticket)
        tl.store(meta32(arena, L.M_PENDING, slot), 1)
        tl.store(meta32(arena, L.M_STATUS, slot), 0)
        if parent >= 0:
            # The parent completes only after this child does (structured completion).
            tl.atomic_add(meta32(arena, L.M_PENDING, parent % slots), 1, sem="relaxed")
    return tid, reserved


@triton.jit
def push_inline(arena, ctx, tid):
    """Put `tid` on top of this worker's inline stack (only this worker touches it: no atomics)."""
    top = p64(ctx + L.X_STACK)
    tl.store(meta64(arena, L.M_THEN_NEXT, tid % tl.load(arena + L.H_POOL)), tl.load(top, volatile=True))
    tl.store(top, tid)
    tl.debug_barrier()      # thread 0 stored; the worker loop reads the top from another thread


@triton.jit
def pop_inline(arena, ctx, top):
    """Take `top`, the top of this worker's inline stack, off it; returns it."""
    after = tl.load(meta64(arena, L.M_THEN_NEXT, top % tl.load(arena + L.H_POOL)), volatile=True)
    tl.store(p64(ctx + L.X_STACK), after)
    tl.debug_barrier()
    return top


@triton.jit
def spill_inline(arena, ctx):
    """Move this worker's inline stack to the ready ring, oldest last, so any worker can run it
    (before a join holds this worker: a joined child may be on the stack)."""
    top = tl.load(p64(ctx + L.X_STACK), volatile=True)
    tl.store(p64(ctx + L.X_STACK), i64(-1))
    tl.debug_barrier()
    while top >= 0:
        after = tl.load(meta64(arena, L.M_THEN_NEXT, top % tl.load(arena + L.H_POOL)), volatile=True)
        push(arena, top)
        top = after


@triton.jit
def poll_words(arena, worker):
    """(stop word, graph runs released, top of this worker's inline stack) in one round trip: one
    thread loads the three, a reduction hands them to the others."""
    k = tl.arange(0, 4)
    rows = tl.arange(0, UNIFORM)[:, None]
    top = (CTX_BASE + worker * CTX_WORDS + L.X_STACK) // 2
    offs = tl.where(k == 0, (CTL + LINE * L.C_STOP) // 2, tl.where(k == 1, (CTL + LINE * L.C_RUN_SEQ) // 2, top))
    block = tl.load(p64(arena) + (offs[None, :] + 0 * rows), mask=(rows == 0) & (k < 3)[None, :],
                    other=-(2**62), volatile=True)
    m = tl.max(block, axis=0)
    return (tl.sum(tl.where(k == 0, m, 0), axis=0), tl.sum(tl.where(k == 1, m, 0), axis=0),
            tl.sum(tl.where(k == 2, m, 0), axis=0))


@triton.jit
def next_task(arena, ctx, top, BACKEND: tl.constexpr):
    """The task this worker runs next: the top of its inline stack (top >= 0), else one from the ring.
    Marks the context (X_INLINE) so the task's own spawns stay on the stack (device.spawn)."""
    if top >= 0:
        tid = pop_inline(arena, ctx, top)
    else:
        tid = try_pop(arena, BACKEND)
    # Only when a task was taken (an idle poll stores nothing); run_dynamic's barrier orders it before the body.
    tl.store(ctx + L.X_INLINE, (top >= 0).to(tl.int32), mask=tid >= 0)
    return tid
