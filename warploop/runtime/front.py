"""The front: the one program of the resident kernel that talks to the host.

Only the front reads the host block, so the bus sees one poller instead of one per worker. Each
`front_step` it:

1. copies the host's stop word into the arena (workers only ever read device memory);
2. takes at most one submitted descriptor from the submit ring and makes it a ready task whose
   completion is reported back to the host (or, for an OP_EXTERNAL request, completes the
   external handle it names: external.py);
3. runs the graph state machine: when every worker has finished the last released run, it
   either releases the next repeat (unless a node set the graph's halt word: Graph.halt_address),
   or reports the finished request to the host and starts the
   next one, copying its parameters into the graph's device-side parameter block.

State lives in arena control words, not registers, so the CPU executor can call `front_step` as
its own interpreted kernel between tasks.
"""
import triton
import triton.language as tl

from warploop.runtime import layout as L
from warploop.runtime.external import is_request, resume_external
from warploop.runtime.sched import push
from warploop.runtime.slots import alloc_task
from warploop.runtime.sync import (
    ABORT,
    DRAIN,
    GRAPH_WORDS,
    GREQ_SLOTS,
    GREQ_WORDS,
    HOST_GREQ,
    HOST_SUBMIT,
    MAX_PARAMS,
    PARK,
    RUN,
    SLOT_DESC,
    SLOT_WORDS,
    acquire,
    clock,
    clock_after,
    ctl,
    desc_of,
    fence_sys,
    host_block,
    i64,
    p64,
    stamping,
    stamps,
    uload,
    uload3,
    uload_ctl4,
)

GRAPH_ROUNDS = tl.constexpr(32)
NO_REQUEST = tl.constexpr(-1)      # a request sequence word no request has (they start at 1)


@triton.jit
def graph_entry(arena, gid):
    return arena + tl.load(arena + L.H_GRAPHS) + gid * GRAPH_WORDS


@triton.jit
def release_run(arena, gid, runs):
    """Start run `runs + 1` (one more run of graph `gid`): bump its epoch, then publish it."""
    entry = graph_entry(arena, gid)
    epoch = uload(entry + L.G_RUNS) + 1
    tl.store(entry + L.G_RUNS, epoch)
    tl.store(ctl(arena, L.C_RUN_GID), i64(gid))
    tl.store(ctl(arena, L.C_RUN_EPOCH), i64(epoch))
    tl.debug_barrier()
    tl.atomic_xchg(ctl(arena, L.C_RUN_SEQ), runs + 1, sem="release")


@triton.jit
def graphs_step(arena, host, taken, req_seq, BACKEND: tl.constexpr):
    """Advance the graph state machine; returns True while a graph request is in flight.

    All its state grows monotonically (runs released, requests taken, run count at which the
    current request ends, requests reported), so uload reads it exactly.
    """
    workers = tl.load(arena + L.H_WORKERS)
    # One round trip: only the front writes the first, second and fourth words, and it polls the third.
    runs, reported, done, end = uload_ctl4(arena, L.C_RUN_SEQ, L.C_GREQ_DONE, L.C_GRAPH_DONE, L.C_GREQ_END)
    busy = taken > reported
    if done == runs * workers:      # no run in flight
        acquire(ctl(arena, L.C_GRAPH_DONE))
        gid = uload(ctl(arena, L.C_RUN_GID)).to(tl.int32)
        more = runs < end
        if more:        # a node of the finished run may have ended the request early (G_HALT)
            more = tl.load(graph_entry(arena, gid) + L.G_HALT, volatile=True) == 0
        if more:
            release_run(arena, gid, runs)
        else:
            if busy:
                elapsed = clock(BACKEND) - tl.load(ctl(arena, L.C_GRAPH_T0), volatile=True)
                tl.store(p64(host + L.HB_GRAPH_NS), elapsed)
                tl.store(ctl(arena, L.C_GREQ_DONE), taken)
                tl.debug_barrier()
                tl.atomic_xchg(p64(host + L.HB_GRAPH_DONE), taken, sem="release", scope="sys")
            req = host + HOST_GREQ + (taken % GREQ_SLOTS) * GREQ_WORDS
            busy = req_seq == (taken + 1).to(tl.int32)
            if busy:
                gid = tl.load(req + 1, volatile=True)
                repeat = tl.load(req + 2, volatile=True)
                k = tl.arange(0, MAX_PARAMS)
                params = tl.load(p64(req + 8) + k, volatile=True)
                dst = tl.load(p64(graph_entry(arena, gid) + L.G_PARAMS)).to(tl.pointer_type(tl.int64))
                tl.store(dst + k, params)
                tl.store(graph_entry(arena, gid) + L.G_HALT, 0)
                tl.store(ctl(arena, L.C_GREQ_HEAD), taken + 1)
                tl.store(ctl(arena, L.C_GREQ_END), runs + repeat)
                tl.store(ctl(arena, L.C_GRAPH_T0), clock(BACKEND))
                release_run(arena, gid, runs)
    return busy


@triton.jit
def maybe_park(arena, host, head, taken, active, BACKEND: tl.constexpr):
    """Park the kernel once it has been idle for the header's H_PARK_NS, or at once when the host
    asks (HB_PARK_NOW); returns True if it parks.

    Idle: no submission taken this round, no graph request in flight, no live task. Parking is a
    handshake with the host's submit (docs/runtime.md, "Parking"): the front publishes an odd park
    generation, fences, and reads the submit and graph-request slots again. The host writes a slot,
    fences, then reads the generation. One of the two sees the other's write: if the front sees a
    new slot it cancels (an even generation) and goes on; otherwise it commits, and the host, which
    then sees the odd generation, launches the kernel again once every program has exited.
    """
    park_ns = tl.load(p64(arena + L.H_PARK_NS))
    now = clock(BACKEND)
    idle = (park_ns >= 0) & (not active)
    if idle:
        idle = uload(ctl(arena, L.C_COMPLETED)) == uload(ctl(arena, L.C_NEXT_ID))
    parked = False
    if idle:
        due = now - tl.load(ctl(arena, L.C_IDLE_SINCE), volatile=True) >= park_ns
        if not due:     # the host may ask for it now (Runtime.park: before work that needs the SMs)
            due = uload(host + L.HB_PARK_NOW) != 0
        if due:
            gen = uload(host + L.HB_PARK)
            tl.atomic_xchg(host + L.HB_PARK, gen | 1, sem="acq_rel", scope="sys")
            fence_sys(BACKEND)
            slot_off = HOST_SUBMIT + (head % tl.load(arena + L.H_SUBMIT)) * SLOT_WORDS
            req_off = HOST_GREQ + (taken % GREQ_SLOTS) * GREQ_WORDS
            stop, slot_seq, req_seq = uload3(host, L.HB_STOP, slot_off.to(tl.int32), req_off.to(tl.int32))
            late = (slot_seq == (head + 1).to(tl.int32)) | (req_seq == (taken + 1).to(tl.int32)) | (stop != RUN)
            if late:      # work (or a stop) arrived while parking: cancel, the host will not relaunch
                tl.atomic_xchg(host + L.HB_PARK, (gen | 1) + 1, sem="release", scope="sys")
                tl.store(ctl(arena, L.C_IDLE_SINCE), now)
            else:
                # The runs every worker has seen (none is in flight): a relaunched worker starts from
                # this, not from C_RUN_SEQ, which the front may already have bumped by then.
                tl.store(ctl(arena, L.C_PARK_SEQ), uload(ctl(arena, L.C_RUN_SEQ)))
                tl.atomic_xchg(ctl(arena, L.C_STOP), i64(PARK), sem="release")
                parked = True
    else:
        tl.store(ctl(arena, L.C_IDLE_SINCE), now)
    return parked


@triton.jit
def front_step(arena, BACKEND: tl.constexpr):
    """One round of host bridging. Returns False once the front may exit (draining, nothing left)."""
    host = host_block(arena)
    if BACKEND == "cuda":
        on = stamping(arena)
        last_round = tl.load(stamps(arena) + L.ST_ROUND, volatile=True)
        t_poll = clock(BACKEND)
    seen_stop, head, taken, reported = uload_ctl4(arena, L.C_STOP, L.C_SUBMIT_HEAD, L.C_GREQ_HEAD, L.C_GREQ_DONE)
    # While a graph request runs, step its state machine GRAPH_ROUNDS times (device reads only) before
    # the next bus read: a run's end is seen, and the next repeat released, within one L2 round trip
    # instead of one host round trip. A submission or stop waits at most those rounds longer.
    # (Not on the CPU executor: there the workers cannot move while the front runs.)
    if BACKEND != "cpu":
        rounds = 0
        going = taken > reported
        while going & (rounds < GRAPH_ROUNDS):
            going = graphs_step(arena, host, taken, NO_REQUEST, BACKEND)
            rounds += 1
    slot_off = HOST_SUBMIT + (head % tl.load(arena + L.H_SUBMIT)) * SLOT_WORDS
    req_off = HOST_GREQ + (taken % GREQ_SLOTS) * GREQ_WORDS
    stop, slot_seq, req_seq = uload3(host, L.HB_STOP, slot_off.to(tl.int32), req_off.to(tl.int32))
    if stop > seen_stop:
        tl.atomic_xchg(ctl(arena, L.C_STOP), i64(stop), sem="release")
    slot = host + slot_off
    took = slot_seq == (head + 1).to(tl.int32)
    placed = took       # taken off the ring (a task submission may have to wait for a slot)
    if took:
        if BACKEND == "cuda":
            t_seen = clock_after(slot_seq, BACKEND)
        k = tl.arange(0, 32)
        words = tl.load(slot + SLOT_DESC + k, volatile=True)
        request = is_request(words, k)
        if BACKEND == "cuda":
            t_desc = clock_after(request.to(tl.int64), BACKEND)
        if request:      # the host completes an external handle (external.py)
            resume_external(arena, words, k)
        else:
            # The front's reserve has a slot per submit slot, so this fails only for a layout built
            # with fewer: then the submission waits in its slot for a later round.
            tid, reserved = alloc_task(arena, i64(-1), head, -1)
            placed = tid >= 0
            if placed:
                tl.store(desc_of(arena, tid % tl.load(arena + L.H_POOL)) + k, words)
                push(arena, tid)
        if BACKEND == "cuda":
            st = stamps(arena)
            ks = tl.arange(0, 8)
            row = tl.where(ks == 0, last_round, tl.where(ks == 1, t_poll, tl.where(ks == 2, t_seen, tl.where(
                ks == 3, t_desc, tl.where(ks == 4, clock(BACKEND), head)))))
            tl.store(st + L.ST_PREV_ROUND + ks, row, mask=on & (ks < 6))
        if placed:
            tl.store(ctl(arena, L.C_SUBMIT_HEAD), head + 1)
            tl.atomic_xchg(p64(host + L.HB_SUBMIT_HEAD), head + 1, sem="release", scope="sys")
    # The graph state machine has nothing to do unless a request is in flight or has arrived.
    busy = taken > reported
    if busy | (req_seq == (taken + 1).to(tl.int32)):
        busy = graphs_step(arena, host, taken, req_seq, BACKEND)
    if BACKEND == "cuda":
        tl.store(stamps(arena) + L.ST_ROUND, t_poll, mask=on)
    tl.debug_barrier()      # this program's own state words: visible to all its warps next round
    # Exit on abort; when draining, only after a whole round that began with the stop word
    # already seen found nothing to take (bus reads may pass each other within one round).
    # The front outlives the workers: only it copies the host's stop word, and a drain that
    # never finishes must still be abortable.
    alive = seen_stop < ABORT
    if (seen_stop == RUN) & (stop == RUN):
        if maybe_park(arena, host, head + placed.to(tl.int64), taken, took | busy, BACKEND):
            alive = False
    if (seen_stop == DRAIN) & (not took) & (not busy):
        tl.atomic_xchg(ctl(arena, L.C_FRONT_DONE), i64(1), sem="release")
        alive = uload(ctl(arena, L.C_EXITED)) < tl.load(arena + L.H_WORKERS)
    return alive

