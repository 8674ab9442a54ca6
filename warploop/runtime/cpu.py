"""The CPU executor: the same runtime, one task at a time, through the Triton interpreter.

The interpreter runs a kernel's programs one after another, so nothing may spin waiting for
another program. The executor therefore schedules in Python and hands each step to the
generated kernels (codegen.py), which run the device code unchanged:

* `cpu_front`       one front_step, when the host block holds something for it;
* `cpu_graph_inst`  the next instruction of a worker's list, once its counters are satisfied;
* `cpu_dynamic`     pop one ready task, run it, complete it.

`join` is the one device call replaced: instead of spinning it runs other work until the handle
completes. A join with no worker left to run the child is the deadlock the GPU would hit, and is
reported as one. Host waits drive this loop, so CPU programs run inside `Future.result()`.
"""
from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from warploop.runtime import device, interp
from warploop.runtime import layout as L
from warploop.runtime.descriptor import DESC_WORDS, to_i32
from warploop.runtime.errors import RuntimeFault
from warploop.runtime.external import EXTERNAL_TICKET
from warploop.runtime.status import read_error
from warploop.runtime.watchdog import Interrupted, Watchdog

DEFAULT_WORKERS = 4


class CpuExecutor:
    backend = "cpu"

    def __init__(self, module, workers: int | None, trace: bool, pool: int, submit_slots: int,
                 ports_addr: int = 0, reserve: int = L.ArenaLayout.reserve) -> None:
        import torch
        self.module = module
        self.workers = DEFAULT_WORKERS if workers is None else workers
        self.layout = L.ArenaLayout(workers=self.workers, pool=pool, reserve=reserve, front_reserve=submit_slots)
        self.host_layout = L.HostLayout(submit_slots=submit_slots)
        self.host_t = torch.zeros(self.host_layout.words, dtype=torch.int32)
        self.host = self.host_t.numpy()
        self.arena = torch.from_numpy(L.initial_arena(self.layout, self.host_t.data_ptr(), 0, submit_slots,
                                                      ports_addr))
        self.a = self.arena.numpy()
        self.a64 = self.a.view(np.int64)
        self.trace = trace
        self.events: list[tuple[int, int, int, int, int]] = []
        self.graphs: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self.position: dict[int, int] = {}     # worker -> next instruction of the current graph run
        self.run_seen = 0
        self.busy: set[int] = set()            # workers with a task on the Python stack
        self.deadline: float | None = None
        self.timeout: float | None = None
        self.what = ""
        self.report: Callable[[], str] = lambda: ""
        self.watchdog = Watchdog()             # ends a step whose task body outlives the deadline
        self.host[L.HB_STARTED] = 1

    # -- words -----------------------------------------------------------------------------------
    def ctl(self, index: int) -> int:
        return int(self.a64[self.layout.ctl_word(index) // 2])

    def _launch(self, kernel, worker: int, *args) -> int:
        """Run one generated CPU kernel for `worker`; returns its start time (ns) for the trace."""
        self.busy.add(worker)
        t0 = time.perf_counter_ns()
        try:
            interp.launch(kernel, (1,), self.arena, *args, overrides={device.join: self._join})
        except (TimeoutError, RuntimeFault):
            raise
        except Exception as exc:
            raise RuntimeFault(f"a task failed on the CPU executor (worker {worker}): {exc!r}") from exc
        finally:
            self.busy.discard(worker)
        return t0

    # -- scheduling ------------------------------------------------------------------------------
    def _front_pending(self) -> bool:
        """Mirror of the conditions under which front_step (front.py) has something to do."""
        h, hl = self.host, self.host_layout
        if h[L.HB_STOP] > self.ctl(L.C_STOP):
            return True
        head = self.ctl(L.C_SUBMIT_HEAD)
        if h[hl.submit + (head % hl.submit_slots) * L.SUBMIT_SLOT_WORDS] == to_i32(head + 1):
            return True
        if self.ctl(L.C_GRAPH_DONE) != self.ctl(L.C_RUN_SEQ) * self.workers:
            return False
        if self.ctl(L.C_GREQ_HEAD) > self.ctl(L.C_GREQ_DONE):
            return True
        # repeats left, unless a node ended the request early (graphs_step reads the same halt word)
        if self.ctl(L.C_RUN_SEQ) < self.ctl(L.C_GREQ_END) and not self._halted(self.ctl(L.C_RUN_GID)):
            return True
        ghead = self.ctl(L.C_GREQ_HEAD)    # requests taken so far
        return h[hl.greq + (ghead % L.GREQ_SLOTS) * L.GREQ_WORDS] == to_i32(ghead + 1)

    def _halted(self, gid: int) -> bool:
        """A node of graph `gid` set its halt word (Graph.halt_address): no further repeat runs."""
        return self.a[self.layout.graphs + gid * L.GRAPH_WORDS + L.G_HALT] != 0

    def _graph_step(self) -> bool:
        runs = self.ctl(L.C_RUN_SEQ)
        if runs > self.run_seen:
            _, table, _ = self.graphs[self.ctl(L.C_RUN_GID)]
            self.position = {w: int(table[2 * w]) for w in range(self.workers)}
            self.run_seen = runs
        if not self.position:
            return False
        insts, table, counters = self.graphs[self.ctl(L.C_RUN_GID)]
        epoch = self.ctl(L.C_RUN_EPOCH)
        progressed = False
        for w in sorted(self.position):
            if w in self.busy or w not in self.position:
                continue
            i, end = self.position[w], int(table[2 * w] + table[2 * w + 1])
            if i < end:
                d = insts[i * DESC_WORDS:(i + 1) * DESC_WORDS]
                waits = [(d[4 + 2 * k], d[5 + 2 * k]) for k in range(2) if d[4 + 2 * k] >= 0]
                # An out-of-range counter is left for the device code to report as a bad descriptor.
                if any(0 <= c < len(counters) and counters[c] < n * epoch for c, n in waits):
                    continue
            last = i + 1 >= end
            if last:
                del self.position[w]
            else:
                self.position[w] = i + 1
            t0 = self._launch(self.module.cpu_graph_inst, w, w, i if i < end else -1, int(last))
            if self.trace and i < end:
                self.events.append((t0, time.perf_counter_ns(), int(insts[i * DESC_WORDS]), w,
                                    int(insts[i * DESC_WORDS + 1])))
            progressed = True
        return progressed

    def _stack_top(self, worker: int) -> int:
        return int(self.a64[(self.layout.ctx + worker * L.CTX_WORDS + L.X_STACK) // 2])

    def _dynamic_step(self) -> bool:
        """Run one dynamic task: a free worker's inline stack first (what the worker loop does after
        a body that spawned into a full pool), else the ring's head on the first free worker."""
        free = [w for w in range(self.workers) if w not in self.busy and w not in self.position]
        stacked = [w for w in free if self._stack_top(w) >= 0]
        head, tail = self.ctl(L.C_RING_HEAD), self.ctl(L.C_RING_TAIL)
        if stacked:
            worker = stacked[0]
            tid = self._stack_top(worker)
        elif free and head < tail:
            worker = free[0]
            tid = int(self.a64[self.layout.ring_off // 2 + head % self.layout.ring]) - 1
        else:
            return False
        opcode = int(self.a[self.layout.pool_desc + (tid % self.layout.slots) * DESC_WORDS])
        t0 = self._launch(self.module.cpu_dynamic, worker, worker)
        if self.trace:
            self.events.append((t0, time.perf_counter_ns(), opcode, worker, tid))
        return True

    def _step(self) -> bool:
        progressed = False
        if self._front_pending():
            self._launch(self.module.cpu_front, -1)
            progressed = True
        progressed |= self._graph_step()
        return self._dynamic_step() or progressed

    def _drive(self, ready: Callable[[], bool]) -> None:
        while not ready():
            self.check()
            if self.deadline is not None and time.perf_counter() > self.deadline:
                raise TimeoutError(f"timed out after {self.timeout:g} s waiting for {self.what}\n"
                                   f"{self.report()}".rstrip())
            if not self._step():
                if self._awaiting_host():
                    time.sleep(20e-6)   # another thread (the std server) will complete a handle
                    continue
                raise TimeoutError(f"waiting for {self.what}, but nothing can run: a task waits on work that "
                                   f"no free worker can do (deadlock)\n{self.report()}".rstrip())

    def _awaiting_host(self) -> bool:
        """True while an external handle (wl.external) is pending: the host completes it, so a
        step that finds nothing to run is waiting for the host, not deadlocked."""
        lay = self.layout
        tickets = self.a64[lay.meta64(L.M_HOST_TICKET) // 2:][:lay.slots]
        pending = self.a[lay.meta32(L.M_PENDING):][:lay.slots]
        return bool(((tickets == EXTERNAL_TICKET) & (pending > 0)).any())

    def _join(self, ctx, handle) -> None:
        h = interp.scalar(handle)
        slots = self.layout.slots
        if not 0 <= h <= self.a64[self.layout.meta64(L.M_ISSUED) // 2 + h % slots]:
            return interp.call_original(device.join, ctx, handle)     # reports the bad handle
        interp.call_original(device.spill_inline, interp.call_original(device.arena_of, ctx), ctx)
        word = (interp.scalar(ctx) - self.arena.data_ptr()) // 4
        self.a[word + L.X_STATE], self.a[word + L.X_DETAIL] = L.S_JOINING, to_i32(h)
        slot = self.layout.meta64(L.M_DONE) // 2 + h % slots
        self._drive(lambda: self.a64[slot] >= h)
        self.a[word + L.X_STATE] = L.S_RUNNING

    # -- the backend interface used by Runtime ----------------------------------------------------
    def wait(self, ready: Callable[[], bool], timeout: float | None, what: str,
             report: Callable[[], str] | None = None) -> None:
        deadline = None if timeout is None else time.perf_counter() + timeout
        # A wait inside a wait (a join's, or a submit's inside a host call) keeps the outer deadline.
        armed = deadline is not None and self.watchdog.arm(deadline)
        if armed or self.deadline is None:
            self.deadline = deadline
            self.timeout, self.what, self.report = timeout, what, report or (lambda: "")
        try:
            try:
                self._drive(ready)
            finally:
                if armed:
                    self.watchdog.disarm()
                    self.deadline = None
        except Interrupted:
            raise TimeoutError(f"timed out after {self.timeout:g} s waiting for {self.what}: a task body was "
                               f"still running at the deadline and was interrupted (its task will never "
                               f"complete; close this runtime)\n{self.report()}".rstrip()) from None

    def check(self) -> None:
        err = read_error(self.host)
        if err and err["fatal"]:
            raise RuntimeFault(f"runtime fault: {err['message']} (opcode {err['opcode']}, worker {err['worker']}, "
                               f"node/detail {err['detail']})")

    def snapshot(self) -> np.ndarray:
        return self.a.copy()

    def empty(self, n: int, dtype):
        import torch
        return torch.zeros(n, dtype=dtype)

    def upload(self, dst, src: np.ndarray) -> None:
        import torch
        dst.copy_(torch.from_numpy(np.ascontiguousarray(src)))

    def write_arena(self, offset: int, words: np.ndarray) -> None:
        self.a[offset:offset + len(words)] = words

    def register_graph(self, gid: int, insts, table, counters) -> None:
        self.graphs[gid] = (insts.numpy(), table.numpy(), counters.numpy())

    def trace_events(self) -> list[tuple[int, int, int, int, int]]:
        return list(self.events)

    def resume(self) -> None:
        """The CPU executor never parks: nothing to relaunch."""

    def park(self, timeout: float) -> bool:
        """Nothing to park: the CPU executor holds no SMs."""
        return False

    def run_resident_inline(self) -> None:
        """Run the GPU's own resident loop (one program playing front and worker) until drained.

        A check of the device loop itself, not only of the steps: queue work first (submit,
        graph launch), then call this; it returns when everything queued has completed.
        """
        if self.workers != 1:
            raise ValueError("the inline resident loop plays a single worker: create the Runtime with workers=1")
        self.host[L.HB_STOP] = L.DRAIN
        interp.launch(self.module.resident, (1,), self.arena, INLINE=True, TRACE=False, BACKEND="cpu")
        self.host[L.HB_STOP] = L.RUN
        self.a64[self.layout.ctl_word(L.C_STOP) // 2] = L.RUN
        self.a64[self.layout.ctl_word(L.C_FRONT_DONE) // 2] = 0

    def stop(self, abort: bool, timeout: float) -> None:
        if not abort:
            idle = lambda: (self.ctl(L.C_NEXT_ID) == self.ctl(L.C_COMPLETED) and not self._front_pending()
                            and not self.position)
            try:
                self.wait(idle, timeout, "the runtime to drain")
            except (TimeoutError, RuntimeFault):
                abort = True
        self.watchdog.close()
        self.host[L.HB_STOP] = L.ABORT if abort else L.DRAIN
        self.a64[self.layout.ctl_word(L.C_STOP) // 2] = self.host[L.HB_STOP]
        self.host[L.HB_EXITED] = 1
