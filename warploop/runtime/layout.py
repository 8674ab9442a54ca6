"""Every memory layout the resident kernel shares with the host, defined once.

Two regions of int32 words:

* the *arena*, in device memory (CPU memory for the CPU executor): a header, control words, one
  context record per worker, the dynamic task slots (the shared pool, then each worker's reserve,
  then the front's), the ready ring and the graph table;
* the *host block*, in pinned host memory the GPU reads and writes over the bus: the stop word,
  status written by the GPU, graph requests, the submit ring and completion records.

`ArenaLayout` and `HostLayout` compute every offset from a few sizes; `header()` is what the host
writes at word 0 of the arena, and the device code (device.py) reads offsets back from it, so a
layout change is made here and nowhere else. docs/runtime.md draws the same tables.
"""
from __future__ import annotations

import dataclasses

from warploop.runtime.descriptor import DESC_WORDS, split64

MAGIC = 0x574C5254  # "WLRT"
VERSION = 2

LINE = 32          # words per control line: 128 bytes, so hot atomics never share a cache line
HEADER_WORDS = 64

# Header word indices (arena[0:64]).
H_MAGIC, H_VERSION, H_WORKERS, H_POOL, H_RING, H_SUBMIT, H_MAX_GRAPHS, H_TRACE_CAP = range(8)
H_CTX, H_POOL_DESC, H_POOL_META, H_POOL_I32, H_RING_OFF, H_GRAPHS, H_CTL = range(8, 15)
H_HOST_ADDR = 16     # int64: address of the host block as the device sees it
H_TRACE_ADDR = 18    # int64: trace buffer address (0: tracing off)
H_PORTS_ADDR = 20    # int64: warploop.std port array (Runtime(ports=...)), 0 if none
H_SHARED = 22        # slots in the shared pool (Runtime(pool=...)); H_POOL counts every slot
H_RESERVE = 23       # slots reserved per worker, after the shared pool
H_FRONT_RESERVE = 24  # slots reserved for the front (host submissions), after the workers'
H_PARK_NS = 26       # int64: the kernel parks (exits, state kept) after this many ns idle; -1 never

# Control lines: each is one int64 at the start of its own line, at arena word CTL + LINE * index.
(C_STOP, C_RING_HEAD, C_RING_TAIL, C_NEXT_ID, C_COMPLETED, C_RUN_SEQ, C_RUN_GID, C_RUN_EPOCH,
 C_GRAPH_DONE, C_SUBMIT_HEAD, C_GREQ_HEAD, C_GREQ_DONE, C_GREQ_END, C_FRONT_DONE, C_ERROR,
 C_GRAPH_T0, C_EXITED, C_IDLE_SINCE, C_PARK_SEQ) = range(19)
N_CTL = 19

# Context record of one worker (int32 words); `ctx` in task code points at the first word.
CTX_WORDS = 32       # one 128-byte line per worker
CTX_BASE = HEADER_WORDS + N_CTL * LINE   # arena word of worker 0's record
X_WORKER, X_STATE = 0, 1
X_TASK = 2           # int64: current dynamic task id (-1 inside a static graph)
X_NODE = 4           # current graph node (-1 for dynamic tasks)
X_DETAIL = 5         # state detail: counter being waited on, low word of a joined handle
X_WAIT = 6           # two counter indices (words 6, 7) for wl.wait() ...
X_WAIT_TARGET = 8    # ... and their int64 targets (words 8-9, 10-11)
X_COUNTERS = 12      # int64: counter array address of the graph being run
X_TRACE = 14         # trace events written by this worker
X_STACK = 16         # int64: top of this worker's inline stack (a task handle, -1: empty)
X_FREE = 18          # int64: first of this worker's free reserved slots (a slot, -1: none), linked by M_THEN_NEXT
X_INLINE = 20        # 1 while the running task came off this worker's inline stack: its spawns go inline too
# worker states
S_IDLE, S_RUNNING, S_WAITING, S_JOINING, S_EXITED = range(5)
STATE_NAMES = ("idle", "running", "waiting on counter", "joining", "exited")

# Stop word values (host -> device). PARK is set by the front alone, in the arena, when the runtime
# has been idle long enough: every program exits with its state kept in the arena, and the host
# launches the kernel again when work arrives (docs/runtime.md, "Parking").
RUN, DRAIN, ABORT, PARK = 0, 1, 2, 3

# Pool metadata: int64 arrays of one entry per slot (all of them), in this order from H_POOL_META ...
# M_DONE / M_ISSUED: the last handle completed / issued in the slot (free when they are equal).
# M_THEN_NEXT links a continuation list, or the inline stack a spawned task sits on.
M_DONE, M_PARENT, M_THEN_HEAD, M_THEN_NEXT, M_RESULT, M_HOST_TICKET, M_ISSUED = range(7)
N_META64 = 7
# ... and int32 arrays of P entries from H_POOL_I32.
M_PENDING, M_STATUS = range(2)
N_META32 = 2

# Graph table entry (int32 words).
GRAPH_WORDS = 16
G_INSTS, G_WORKER_TABLE, G_COUNTERS, G_PARAMS = 0, 2, 4, 6   # int64 addresses
G_NINST, G_NCOUNTERS, G_NPARAMS, G_RUNS = 8, 9, 10, 11        # G_RUNS: runs released so far (epoch)
G_HALT = 12         # nonzero: a node asked to end the request after the run in flight (Graph.halt_address)

# Error record in the arena's C_ERROR line and mirrored in the host block (int32 words).
E_CODE, E_OPCODE, E_WORKER, E_DETAIL, E_TASK, E_FATAL = 0, 1, 2, 3, 4, 6   # E_TASK: int64, words 4-5

TRACE_WORDS = 8      # per event: start ns, end ns (int64), opcode, worker, id (int64)

# Submit stamps: GPU global-timer readings along the last host submission's path, for
# warploop/bench/runtime_submit.py. They live in the spare words of the C_SUBMIT_HEAD control line
# (its control word takes two of 32). The host turns them on by writing 1 to STAMP_ON; off, each
# costs the device a store it masks away and one load per front round or pop issued with others.
STAMP_ON = 2         # int32 word of the C_SUBMIT_HEAD line: 0 off, 1 on
STAMP_BASE = 4       # int32 word of the first int64 stamp
(ST_ROUND, ST_PREV_ROUND, ST_POLL, ST_SEEN, ST_DESC, ST_PUSHED, ST_TAKEN_TICKET, ST_POPPED, ST_BODY_DONE,
 ST_NOTIFY, ST_NOTIFIED, ST_DONE_TICKET) = range(12)
STAMP_NAMES = ("round", "prev_round", "poll", "seen", "desc", "pushed", "taken_ticket", "popped", "body_done",
               "notify", "notified", "done_ticket")


@dataclasses.dataclass(frozen=True)
class ArenaLayout:
    """Word offsets of every arena region, from the sizes chosen at Runtime start."""

    workers: int
    pool: int = 4096          # shared slots: any task, from any worker or the host
    max_graphs: int = 64
    trace_cap: int = 0        # trace events per worker (0: tracing off)
    reserve: int = 256        # slots per worker for spawns into a full pool (run inline: docs/runtime.md)
    front_reserve: int = 256  # slots for host submissions into a full pool: the submit slots, so one never waits

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError(f"workers must be at least 1, got {self.workers}")
        if self.pool < 2 or self.pool & (self.pool - 1):
            raise ValueError(f"pool size must be a power of two >= 2, got {self.pool}")
        if self.reserve < 1 or self.front_reserve < 1:
            raise ValueError(f"reserve={self.reserve}, front_reserve={self.front_reserve}: each must be at least 1")

    @property
    def slots(self) -> int:
        """Every task slot: the shared pool, each worker's reserve, the front's reserve."""
        return self.pool + self.workers * self.reserve + self.front_reserve

    @property
    def ring(self) -> int:
        # At most one task per slot is alive, so a ring with a place per slot never fills.
        return self.slots

    @property
    def ctl(self) -> int:
        return HEADER_WORDS

    @property
    def ctx(self) -> int:
        return CTX_BASE

    @property
    def pool_desc(self) -> int:
        return _align(self.ctx + self.workers * CTX_WORDS, 32)

    @property
    def pool_meta(self) -> int:
        return self.pool_desc + self.slots * DESC_WORDS

    @property
    def pool_i32(self) -> int:
        return self.pool_meta + 2 * N_META64 * self.slots

    @property
    def ring_off(self) -> int:
        return _align(self.pool_i32 + N_META32 * self.slots, 2)

    @property
    def graphs(self) -> int:
        return _align(self.ring_off + 2 * self.ring, 32)

    @property
    def words(self) -> int:
        return self.graphs + self.max_graphs * GRAPH_WORDS

    def ctl_word(self, index: int) -> int:
        return self.ctl + LINE * index

    def meta64(self, array: int) -> int:
        return self.pool_meta + 2 * self.slots * array

    def meta32(self, array: int) -> int:
        return self.pool_i32 + self.slots * array

    def header(self, host_addr: int, trace_addr: int, submit_slots: int, ports_addr: int = 0,
               park_ns: int = -1) -> list[int]:
        """The header words the host writes at arena[0:HEADER_WORDS]."""
        words = [0] * HEADER_WORDS
        fields = {H_MAGIC: MAGIC, H_VERSION: VERSION, H_WORKERS: self.workers, H_POOL: self.slots,
                  H_SHARED: self.pool, H_RESERVE: self.reserve, H_FRONT_RESERVE: self.front_reserve,
                  H_RING: self.ring, H_SUBMIT: submit_slots, H_MAX_GRAPHS: self.max_graphs,
                  H_TRACE_CAP: self.trace_cap, H_CTX: self.ctx, H_POOL_DESC: self.pool_desc,
                  H_POOL_META: self.pool_meta, H_POOL_I32: self.pool_i32, H_RING_OFF: self.ring_off,
                  H_GRAPHS: self.graphs, H_CTL: self.ctl}
        for index, value in fields.items():
            words[index] = value
        words[H_HOST_ADDR:H_HOST_ADDR + 2] = split64(host_addr)
        words[H_TRACE_ADDR:H_TRACE_ADDR + 2] = split64(trace_addr)
        words[H_PORTS_ADDR:H_PORTS_ADDR + 2] = split64(ports_addr)
        words[H_PARK_NS:H_PARK_NS + 2] = split64(park_ns)
        return words

    @classmethod
    def parse(cls, header: list[int]) -> ArenaLayout:
        """Rebuild the layout from header words (checks magic and version)."""
        if header[H_MAGIC] != MAGIC or header[H_VERSION] != VERSION:
            raise ValueError("not a warploop arena header (bad magic or version)")
        return cls(workers=header[H_WORKERS], pool=header[H_SHARED], max_graphs=header[H_MAX_GRAPHS],
                   trace_cap=header[H_TRACE_CAP], reserve=header[H_RESERVE], front_reserve=header[H_FRONT_RESERVE])


# Host block word offsets.
HB_STOP = 0                   # host -> device
HB_STARTED, HB_EXITED, HB_HEARTBEAT = 32, 33, 34                 # device -> host
HB_PARK = 35                  # park generation: odd while the kernel parks or is parked (front), even running (host)
HB_SUBMIT_HEAD = 36           # int64: submit tickets the front has taken
HB_GRAPH_DONE = 38            # int64: graph request seq finished
HB_GRAPH_NS = 40              # int64: device time of the last finished graph request
HB_PARK_NOW = 42              # host -> device: nonzero asks the front to park at its next idle round (Runtime.park)
HB_ERROR = 48                 # error record (E_* words), first error only
GREQ_SLOTS = 8                # graph request ring
MAX_PARAMS = 16
GREQ_WORDS = 8 + 2 * MAX_PARAMS   # seq, gid, repeat, nparams, 4 spare, params (int64)
SUBMIT_SLOT_WORDS = 40            # seq, 7 spare, one task descriptor
SLOT_DESC = 8
# Completion record: three int64 words, each with the submission's sequence number (ticket + 1,
# low 32 bits) in its low half and, in its high half, the status, the result's low word, the
# result's high word; complete once all three carry the sequence (any order of arrival).
COMPLETION_WORDS = 8


@dataclasses.dataclass(frozen=True)
class HostLayout:
    """Word offsets in the pinned host block."""

    submit_slots: int = 256

    def __post_init__(self) -> None:
        if self.submit_slots < 1:
            raise ValueError(f"submit_slots must be at least 1, got {self.submit_slots}")

    @property
    def greq(self) -> int:
        return 64

    @property
    def submit(self) -> int:
        return self.greq + GREQ_SLOTS * GREQ_WORDS

    @property
    def completions(self) -> int:
        return self.submit + self.submit_slots * SUBMIT_SLOT_WORDS

    @property
    def words(self) -> int:
        return self.completions + self.submit_slots * COMPLETION_WORDS


def _align(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


def initial_arena(layout: ArenaLayout, host_addr: int, trace_addr: int, submit_slots: int, ports_addr: int = 0,
                  park_ns: int = -1):
    """The arena's contents before the resident kernel starts (a numpy int32 array)."""
    import numpy as np

    words = np.zeros(layout.words, dtype=np.int32)
    words[:HEADER_WORDS] = layout.header(host_addr, trace_addr, submit_slots, ports_addr, park_ns)
    w64 = words.view(np.int64)
    for w in range(layout.workers):
        base = layout.ctx + w * CTX_WORDS
        words[base + X_WORKER] = w
        w64[(base + X_TASK) // 2] = -1
        words[base + X_NODE] = -1
        words[base + X_WAIT:base + X_WAIT + 2] = -1
        w64[(base + X_STACK) // 2] = -1
        # The worker's reserved slots, all free: a list through their M_THEN_NEXT words.
        first = layout.pool + w * layout.reserve
        w64[(base + X_FREE) // 2] = first
        link = layout.meta64(M_THEN_NEXT) // 2 + first
        w64[link:link + layout.reserve] = np.arange(first + 1, first + layout.reserve + 1)
        w64[link + layout.reserve - 1] = -1
    # Handles in slot s are s + k * slots (k = 0, 1, ...): before the first, the slot's last issued
    # and last completed handle are both s - slots, which makes it free.
    first = np.arange(layout.slots, dtype=np.int64) - layout.slots
    for array in (M_DONE, M_ISSUED):
        w64[layout.meta64(array) // 2:][:layout.slots] = first
    return words
