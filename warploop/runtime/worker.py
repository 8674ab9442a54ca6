"""The worker loop of the resident kernel, with the task bodies reached through `DISPATCH`.

`DISPATCH` is the opcode switch codegen.py generates for one set of tasks; everything else here
is the same for every runtime:

    program 0 (the front)          programs 1..W (workers)
    ---------------------          -----------------------
    loop:                          loop:
      front_step()                   stop word says abort?            -> exit
                                     a graph run was released?        -> run my instruction list
                                     a task on my inline stack?       -> run it, complete it
                                     a ready task in the ring?        -> run it, complete it
                                     draining and nothing is alive?   -> exit

With INLINE=True one program plays both parts (the interpreter runs programs one after another,
so a spinning worker would never let the front run).
"""
import triton
import triton.language as tl

from warploop.runtime import descriptor as D
from warploop.runtime import errors as E
from warploop.runtime import layout as L
from warploop.runtime.front import front_step, graph_entry
from warploop.runtime.sched import complete, report_error, write_trace
from warploop.runtime.slots import next_task, poll_words
from warploop.runtime.sync import (
    ABORT,
    ARG_WORD,
    CTX_BASE,
    CTX_WORDS,
    DESC_WORDS,
    DRAIN,
    MAX_PARAMS,
    acquire,
    clock,
    ctl,
    desc_of,
    host_block,
    i64,
    idle_pause,
    p64,
    uload,
    uload_ctl2,
    wait_pair,  # noqa: F401 (the generated dispatch calls W.wait_pair)
)

ERR_BAD_DESCRIPTOR = tl.constexpr(E.ERR_BAD_DESCRIPTOR)
MAX_ARGS = tl.constexpr(D.MAX_ARGS)


@triton.jit
def ctx_of(arena, worker):
    return arena + CTX_BASE + worker * CTX_WORDS


@triton.jit
def slot(a, j: tl.constexpr, ok, NSLOTS: tl.constexpr, VOLATILE: tl.constexpr):
    """Argument slot j (int64) of a descriptor's slots `a`; 0 without a load past the task set's widest."""
    if j < NSLOTS:
        v = tl.load(a + j, mask=ok, other=0, volatile=VOLATILE)
    else:
        v = i64(0)
    return v


@triton.jit
def desc_words(d, ok, NSLOTS: tl.constexpr, VOLATILE: tl.constexpr):
    """Descriptor d as ((8 header words), (12 argument slots)); nothing is read unless ok.

    Every load is issued before any is used, so the whole descriptor (one 128-byte line) costs one
    round trip, and the generated dispatch decodes arguments from registers. Volatile for pool
    descriptors (slots are reused); plain for graph instructions, which never change while their
    graph exists: the acquire that starts each run invalidates L1, so a plain load cannot see a
    line left from a graph that used the same memory before.
    """
    h = (tl.load(d, mask=ok, other=0, volatile=VOLATILE), tl.load(d + 1, mask=ok, other=0, volatile=VOLATILE),
         tl.load(d + 2, mask=ok, other=0, volatile=VOLATILE), tl.load(d + 3, mask=ok, other=0, volatile=VOLATILE),
         tl.load(d + 4, mask=ok, other=0, volatile=VOLATILE), tl.load(d + 5, mask=ok, other=0, volatile=VOLATILE),
         tl.load(d + 6, mask=ok, other=0, volatile=VOLATILE), tl.load(d + 7, mask=ok, other=0, volatile=VOLATILE))
    a = p64(d + ARG_WORD)
    args = (slot(a, 0, ok, NSLOTS, VOLATILE), slot(a, 1, ok, NSLOTS, VOLATILE), slot(a, 2, ok, NSLOTS, VOLATILE),
            slot(a, 3, ok, NSLOTS, VOLATILE), slot(a, 4, ok, NSLOTS, VOLATILE), slot(a, 5, ok, NSLOTS, VOLATILE),
            slot(a, 6, ok, NSLOTS, VOLATILE), slot(a, 7, ok, NSLOTS, VOLATILE), slot(a, 8, ok, NSLOTS, VOLATILE),
            slot(a, 9, ok, NSLOTS, VOLATILE), slot(a, 10, ok, NSLOTS, VOLATILE), slot(a, 11, ok, NSLOTS, VOLATILE))
    return h, args


@triton.jit
def inst_words(insts, i, end, NSLOTS: tl.constexpr):
    """Instruction i of a graph's list (all zeros, nothing read, once i reaches end)."""
    return desc_words(insts + i * DESC_WORDS, i < end, NSLOTS, False)


@triton.jit
def prefetch_l1(p, ok, BACKEND: tl.constexpr):
    """Ask L1 for the 128-byte line at p (CUDA: prefetch.global.L1; no register waits for it)."""
    if BACKEND == "cuda" and ok:
        tl.inline_asm_elementwise("prefetch.global.L1 [$1]; mov.u32 $0, 0;", "=r,l", [p], dtype=tl.int32,
                                  is_pure=False, pack=1)


@triton.jit
def arg(a, j: tl.constexpr, pmask, params):
    """Argument j, from the slots the worker loaded, or from the graph parameters when its mask bit is
    set. A plain load: the front writes the parameters before it releases the run, and a worker's
    acquire of the run orders (and invalidates L1 for) every later load."""
    v = a[j]
    if (pmask >> j) & 1:
        v = tl.load(params + (v & (MAX_PARAMS - 1)))
    return v


@triton.jit
def run_dynamic(arena, ctx, worker, tid, DISPATCH: tl.constexpr, NSLOTS: tl.constexpr, TRACE: tl.constexpr,
                BACKEND: tl.constexpr):
    """Run dynamic task `tid` (already claimed from the ring) and complete it."""
    d = desc_of(arena, tid % tl.load(arena + L.H_POOL))
    tl.store(p64(ctx + L.X_TASK), tid)
    tl.store(ctx + L.X_NODE, -1)
    tl.store(ctx + L.X_STATE, L.S_RUNNING)
    h, args = desc_words(d, True, NSLOTS, True)
    op = h[0]
    # Dynamic descriptors carry no graph fields; anything else is a corrupt or foreign descriptor.
    valid = (h[2] == 0) & (h[3] == -1) & (h[4] == -1) & (h[6] == -1)
    if TRACE:
        t0 = clock(BACKEND)
    status = tl.full([], ERR_BAD_DESCRIPTOR, tl.int32)
    tl.debug_barrier()      # the context words above (thread 0 stores) before the body reads them
    if valid:
        nowhere = p64(arena)
        status = DISPATCH(arena, ctx, op, 0, nowhere, args, nowhere, -1, i64(0), -1, i64(0), BACKEND)
    if TRACE:
        write_trace(arena, ctx, worker, t0, clock(BACKEND), op, tid)
    tl.store(ctx + L.X_STATE, L.S_IDLE)
    if status != 0:
        report_error(arena, status, op, worker, -1, tid, 0)
    complete(arena, tid, status, BACKEND)


@triton.jit
def run_inst(arena, ctx, worker, words, counters, ncounters, params, epoch, waited, carry, ahead, insts, nxt, end,
             DISPATCH: tl.constexpr, NSLOTS: tl.constexpr, LATE: tl.constexpr, TRACE: tl.constexpr,
             BACKEND: tl.constexpr):
    """Run one static-graph instruction, its words already loaded: (its waits,) its body, its signal.
    Returns (status, signals still owed, whether the next instruction continues the run, the next
    instruction's words).

    The next instruction (`nxt` of `insts`, none once it reaches `end`) comes in `ahead`, loaded
    before this body, or with LATE is read after it: on CUDA its line was prefetched into L1 before
    the body, so the read is an L1 hit (unless the body's wait invalidated L1). Words loaded before
    a body are live across it; in a tile body (255 registers) ptxas spills them, and a spill's store
    waits for its load: one L2 round trip at the top of every node, before the body issues its weights.

    A run of instructions on one worker with the same waits and the same signal counter (the tiles of
    one GEMV stage) is fenced once: `waited` (the one before had these waits, so they are met) skips
    the wait, and when the next instruction (`ahead`, if `more`) has them too this node's signal is
    added to `carry` instead of released, so the run's last node releases them all with one fence.
    The comparison with `ahead` comes after the body, so its words (loaded one instruction early)
    are not waited for before it. The run's successors wait for its whole count anyway, and no node
    in the run waits for anything the run signals (its waits were met before the run began), so
    deferring cannot deadlock."""
    h, args = words
    op, node, pmask, sig, c0, n0, c1, n1 = h
    valid = ((sig >= -1) & (sig < ncounters) & (c0 >= -1) & (c0 < ncounters) & (c1 >= -1) & (c1 < ncounters)
             & (pmask >= 0) & ((pmask >> MAX_ARGS) == 0))
    tl.store(ctx + L.X_NODE, node)      # for rt.status(): the node this worker is at
    if waited:
        c0 = c0 * 0 - 1
        c1 = c1 * 0 - 1
    if TRACE:
        t0 = clock(BACKEND)
    status = tl.full([], ERR_BAD_DESCRIPTOR, tl.int32)
    # The previous instruction's stores (thread 0 stores scalars) before this body's loads: a node
    # may read what the one before it on this worker wrote, with no counter in between.
    tl.debug_barrier()
    if valid:
        status = DISPATCH(arena, ctx, op, pmask, params, args, counters, c0, n0 * epoch, c1, n1 * epoch, BACKEND)
    if LATE:
        ahead = inst_words(insts, nxt, end, NSLOTS)
    defer = same_stage(h, ahead[0], nxt < end)
    if status == 0:
        if sig >= 0:
            if defer:
                carry += 1
            else:
                tl.debug_barrier()
                tl.atomic_add(counters + sig, i64(carry + 1), sem="release")
                carry = carry * 0
    else:
        # Successors would wait forever on this node: a graph fault stops the runtime.
        report_error(arena, status, op, worker, node, -1, 1)
    if TRACE:
        write_trace(arena, ctx, worker, t0, clock(BACKEND), op, node)
    return status, carry, defer, ahead


@triton.jit
def same_stage(ha, hb, valid_b):
    """Headers ha and hb have the same waits and signal counter, and hb's instruction is one to run."""
    return (valid_b & (ha[3] == hb[3]) & (ha[4] == hb[4]) & (ha[5] == hb[5]) & (ha[6] == hb[6])
            & (ha[7] == hb[7]))


@triton.jit
def graph_run_start(arena, ctx, worker):
    """Read the released run (CPU executor): (first instruction, end, instructions, counters, ncounters,
    params, epoch). Volatile: these words change between runs, and L1 is not coherent with the front.
    Two plain loads, not a uload: the CPU executor runs a program as one block (no warps to agree),
    and the uload's [128, 2] masked load, reduction and picks were the interpreter's most costly part
    of an instruction's overhead."""
    gid = tl.load(ctl(arena, L.C_RUN_GID), volatile=True)
    epoch = tl.load(ctl(arena, L.C_RUN_EPOCH), volatile=True)
    first, end, insts, counters, ncounters, params = graph_lookup(arena, gid, worker)
    tl.store(p64(ctx + L.X_TASK), i64(-1))
    tl.store(p64(ctx + L.X_COUNTERS), counters.to(tl.int64))
    tl.store(ctx + L.X_STATE, L.S_RUNNING)
    tl.store(ctx + L.X_INLINE, 0)
    return first, end, insts, counters, ncounters, params, epoch


@triton.jit
def graph_lookup(arena, gid, worker):
    """A graph's fixed words for this worker: (first instruction, end, instructions, counters,
    ncounters, params). Written once when the graph is compiled, so a worker keeps them across runs."""
    entry = graph_entry(arena, gid.to(tl.int32))
    insts = tl.load(p64(entry + L.G_INSTS), volatile=True).to(tl.pointer_type(tl.int32))
    table = tl.load(p64(entry + L.G_WORKER_TABLE), volatile=True).to(tl.pointer_type(tl.int32))
    counters = tl.load(p64(entry + L.G_COUNTERS), volatile=True).to(tl.pointer_type(tl.int64))
    params = tl.load(p64(entry + L.G_PARAMS), volatile=True).to(tl.pointer_type(tl.int64))
    ncounters = tl.load(entry + L.G_NCOUNTERS, volatile=True)
    first = tl.load(table + 2 * worker, volatile=True)
    return first, first + tl.load(table + 2 * worker + 1, volatile=True), insts, counters, ncounters, params


@triton.jit
def graph_run_end(arena, ctx):
    tl.store(ctx + L.X_STATE, L.S_IDLE)
    tl.debug_barrier()
    tl.atomic_add(ctl(arena, L.C_GRAPH_DONE), i64(1), sem="release")


@triton.jit
def run_graph(arena, ctx, worker, i, end, insts, counters, ncounters, params, epoch, DISPATCH: tl.constexpr,
              NSLOTS: tl.constexpr, TRACE: tl.constexpr, BACKEND: tl.constexpr, LATE: tl.constexpr):
    """Run this worker's instructions [i, end) of the released graph run, in order.

    Software-pipelined: the next instruction's words are loaded while this one waits and runs, so a
    node costs no descriptor round trip of its own, but a body shorter than an L2 round trip still
    waits for its successor's words at the top of the next pass (docs/runtime.md, the instruction path).
    With LATE (a task set with a heavy task: codegen's WORDS_AFTER) the words are not held in
    registers across the body: their line is prefetched into L1 before it (CUDA) and they are read
    after it (run_inst).
    """
    tl.store(p64(ctx + L.X_TASK), i64(-1))
    tl.store(p64(ctx + L.X_COUNTERS), counters.to(tl.int64))
    tl.store(ctx + L.X_STATE, L.S_RUNNING)
    tl.store(ctx + L.X_INLINE, 0)       # a node that spawns queues its children on the ring
    words = inst_words(insts, i, end, NSLOTS)
    waited = i < 0                      # False, as a run-time value: it is loop-carried
    carry = tl.full([], 0, tl.int32)
    while i < end:
        if LATE:
            prefetch_l1(insts + (i + 1) * DESC_WORDS, i + 1 < end, BACKEND)
            ahead = words
        else:
            ahead = inst_words(insts, i + 1, end, NSLOTS)
        status, carry, waited, words = run_inst(arena, ctx, worker, words, counters, ncounters, params, epoch,
                                                waited, carry, ahead, insts, i + 1, end, DISPATCH, NSLOTS, LATE,
                                                TRACE, BACKEND)
        i += 1
        if status != 0:
            i = end
    graph_run_end(arena, ctx)


@triton.jit
def worker_step(arena, ctx, worker, seen, cache, idle, DISPATCH: tl.constexpr, NSLOTS: tl.constexpr,
                TRACE: tl.constexpr, BACKEND: tl.constexpr, LATE: tl.constexpr):
    """One pass of a worker: a released graph run, else one ready task. Returns (alive, runs seen,
    the graph cache, empty polls in a row, which idle_pause backs off with). The cache (gid, first,
    end, insts, counters, ncounters, params) holds the last graph's fixed words, so a replay of the
    same graph starts after two round trips (the acquire, then gid and epoch), not five."""
    gid_c, first_c, end_c, insts_c, counters_c, ncounters_c, params_c = cache
    stop, runs, top = poll_words(arena, worker)
    alive = stop < ABORT
    if alive:
        if runs > seen:
            acquire(ctl(arena, L.C_RUN_SEQ))
            gid, epoch = uload_ctl2(arena, L.C_RUN_GID, L.C_RUN_EPOCH)
            if gid != gid_c:
                first_c, end_c, insts_c, counters_c, ncounters_c, params_c = graph_lookup(arena, gid, worker)
                gid_c = gid
            run_graph(arena, ctx, worker, first_c, end_c, insts_c, counters_c, ncounters_c, params_c, epoch,
                      DISPATCH, NSLOTS, TRACE, BACKEND, LATE)
            seen = runs
            idle = idle * 0
        else:
            tid = next_task(arena, ctx, top, BACKEND)
            if tid >= 0:
                run_dynamic(arena, ctx, worker, tid, DISPATCH, NSLOTS, TRACE, BACKEND)
                idle = idle * 0
            else:
                idle_pause(idle, BACKEND)
                idle += 1
            if (tid < 0) & (stop == DRAIN):
                live = uload(ctl(arena, L.C_NEXT_ID)) - uload(ctl(arena, L.C_COMPLETED))
                alive = (uload(ctl(arena, L.C_FRONT_DONE)) == 0) | (live > 0)
    return alive, seen, (gid_c, first_c, end_c, insts_c, counters_c, ncounters_c, params_c), idle


@triton.jit
def resident_loop(arena, DISPATCH: tl.constexpr, NSLOTS: tl.constexpr, INLINE: tl.constexpr, TRACE: tl.constexpr,
                  BACKEND: tl.constexpr, LATE: tl.constexpr):
    """The whole life of one program of the resident kernel. LATE: read each graph instruction's
    words after the body before it (run_inst), for task sets with a heavy task."""
    pid = tl.program_id(0)
    host = host_block(arena)
    if INLINE:
        worker = pid
        front_on = pid == 0
        worker_on = pid == 0
    else:
        worker = pid - 1
        front_on = pid == 0
        worker_on = pid > 0
    ctx = ctx_of(arena, tl.maximum(worker, 0))
    if worker_on:       # a relaunch after a park: not "exited" any more (rt.status() reads this)
        tl.store(ctx + L.X_STATE, L.S_IDLE)
    if front_on:
        tl.store(ctl(arena, L.C_IDLE_SINCE), clock(BACKEND))
        tl.atomic_xchg(host + L.HB_STARTED, 1, sem="release", scope="sys")
    # Graph runs already seen: 0 at the first launch; after a park (which only happens with no run
    # in flight) every run released before it, as the front recorded when it parked.
    seen = uload(ctl(arena, L.C_PARK_SEQ))
    idle = tl.full([], 0, tl.int32)
    zero = tl.full([], 0, tl.int32)
    cache = (i64(-1), zero, zero, arena, p64(arena), zero, p64(arena))    # no graph yet
    going = front_on | worker_on
    while going:
        if front_on:
            front_on = front_step(arena, BACKEND)
        if worker_on:
            worker_on, seen, cache, idle = worker_step(arena, ctx, worker, seen, cache, idle, DISPATCH, NSLOTS, TRACE,
                                                       BACKEND, LATE)
            if not worker_on:
                tl.atomic_add(ctl(arena, L.C_EXITED), i64(1), sem="release")
        going = front_on | worker_on
    if worker >= 0:
        tl.store(ctx + L.X_STATE, L.S_EXITED)
    tl.debug_barrier()
    tl.atomic_add(host + L.HB_EXITED, 1, sem="release", scope="sys")


@triton.jit
def graph_inst_step(arena, worker, index, last, DISPATCH: tl.constexpr, NSLOTS: tl.constexpr):
    """CPU executor: run instruction `index` (-1: none) of the released run for `worker`."""
    ctx = ctx_of(arena, worker)
    i, end, insts, counters, ncounters, params, epoch = graph_run_start(arena, ctx, worker)
    if index >= 0:
        words = inst_words(insts, index, index + 1, NSLOTS)
        run_inst(arena, ctx, worker, words, counters, ncounters, params, epoch, False, tl.full([], 0, tl.int32),
                 words, insts, end, end, DISPATCH, NSLOTS, False, False, "cpu")
    if last != 0:
        graph_run_end(arena, ctx)


@triton.jit
def dynamic_step(arena, worker, DISPATCH: tl.constexpr, NSLOTS: tl.constexpr):
    """CPU executor: run the task `worker` would take next (inline stack, else ring), if any."""
    ctx = ctx_of(arena, worker)
    tid = next_task(arena, ctx, tl.load(p64(ctx + L.X_STACK), volatile=True), "cpu")
    if tid >= 0:
        run_dynamic(arena, ctx, worker, tid, DISPATCH, NSLOTS, False, "cpu")
