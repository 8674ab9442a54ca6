"""`warploop.Runtime`: the host side of the resident kernel.

    with warploop.Runtime(tasks=[scale]) as rt:      # starts the resident kernel (or the CPU executor)
        rt.submit(scale, x, n, 2.0).result(timeout=1.0)
        g = rt.graph(); ...; g.run()

Work reaches the kernel through the pinned host block (layout.py), never through a launch:
`submit` writes a descriptor into the next submit-ring slot and its sequence word last; the
front copies it into the task pool; the completion record comes back into the host block, where
`Future.result` polls it. Every host wait has a timeout that raises TimeoutError naming the
pending tasks and what each worker is doing; `close()` always stops the kernel (drain, then
abort), also after an exception or Ctrl-C inside a `with` block.
"""
from __future__ import annotations

import threading
import time

import numpy as np

from warploop.runtime import layout as L
from warploop.runtime import trace as trace_mod
from warploop.runtime.descriptor import ARG_WORD, TaskDescriptor, to_i32
from warploop.runtime.errors import RuntimeFault, TaskError, describe
from warploop.runtime.external import OP_EXTERNAL
from warploop.runtime.graph import Graph
from warploop.runtime.status import RuntimeStatus, read_status
from warploop.runtime.tasks import REGISTRY, ArgSpec, Task, lookup
from warploop.target import select_device

DEFAULT_TIMEOUT_S = 60.0
DEFAULT_PARK_AFTER_US = 200.0


class Future:
    """The result of a host-submitted task: its int64 result (wl.set_result), or TaskError."""

    __slots__ = ("_rt", "ticket", "name", "_settled", "_status", "_value", "_rec", "_seq")

    def __init__(self, rt: Runtime, ticket: int, name: str, rec: int) -> None:
        self._rt, self.ticket, self.name = rt, ticket, name
        self._settled, self._status, self._value = False, 0, 0
        self._rec, self._seq = rec, (ticket + 1) & 0xFFFFFFFF    # completion record (int64 index), its sequence

    def done(self) -> bool:
        if not self._settled:
            self._rt._settle(self)
        return self._settled

    def result(self, timeout: float | None = None) -> int:
        """The task's result; TimeoutError after `timeout` s (default: the Runtime's), RuntimeError at
        once if the Runtime was closed before the task completed."""
        if not self._settled:
            self._rt._settle(self)
            if not self._settled:
                self._rt._wait(self.done, timeout, _Pending(self))
        if self._status:
            raise TaskError(f"task {self.name} (submission {self.ticket}) failed: {describe(self._status)}"
                            f"{self._rt._error_detail()}")
        return self._value


class _Pending:
    """A waiting future's description, formatted only if the wait times out."""

    __slots__ = ("future",)

    def __init__(self, future: Future) -> None:
        self.future = future

    def __str__(self) -> str:
        return f"task {self.future.name} (submission {self.future.ticket})"


class GraphFuture:
    """A queued graph request (one or more runs)."""

    def __init__(self, rt: Runtime, seq: int) -> None:
        self._rt, self.seq = rt, seq

    def done(self) -> bool:
        return self._rt._h64[L.HB_GRAPH_DONE // 2] >= self.seq

    def result(self, timeout: float | None = None) -> None:
        """Wait for the request's runs: TimeoutError after `timeout` s, RuntimeError once the Runtime is closed."""
        if not self.done():
            self._rt._wait(self.done, timeout, f"graph request {self.seq}")

    def wait(self, until, timeout: float | None = None) -> None:
        """Wait until `until()` (a read of host-visible memory the request's nodes write) is true or
        the request is done; on the CPU executor this runs the request meanwhile, so a request of
        many runs can hand out each run's results as they are made."""
        if not (until() or self.done()):
            self._rt._wait(lambda: until() or self.done(), timeout, f"graph request {self.seq}")

    @property
    def device_ns(self) -> int:
        """Device time of the most recently finished request, on the GPU's global timer (0 on CPU)."""
        return int(self._rt._h64[L.HB_GRAPH_NS // 2])


class Runtime:
    def __init__(self, device=None, workers: int | str | None = None, worker_warps: int = 4, trace: bool = False, *,
                 tasks=None, pool: int = 4096, submit_slots: int = 256, timeout: float = DEFAULT_TIMEOUT_S,
                 ports=None, park_after_us: float | None = DEFAULT_PARK_AFTER_US,
                 sm_fraction: float | None = None, reserve: int = 256, max_registers: int | None = None) -> None:
        """Start the resident kernel for `tasks` (default: every task registered so far).

        device: "cuda", "hip", "cpu" or None (WARPLOOP_DEVICE, else the first GPU, else the CPU).
        workers: worker programs (default: as many as fit co-resident, less one slot per SM left for
            other kernels; 4 on the CPU executor). "fill": every slot (less the front's), so kernels
            launched beside the runtime wait for it to park (Runtime.park).
        worker_warps: warps per worker; 1 makes each worker a single warp.
        trace: record start/end times of every task for save_trace().
        timeout: default for every host wait, in seconds.
        ports: a warploop.std port array (allocate_ports) that tasks reach with wl.ports(ctx).
        park_after_us: on a GPU, park the resident kernel (exit, state kept) after this long idle, so
            CUDA work that synchronises the context (a module's first load, torch.cuda.synchronize())
            completes; it is launched again when work arrives. None: never park (such work then
            waits until close()).
        pool: task slots shared by all workers; reserve: slots per worker that a spawn into a full
            pool takes (the child then runs inline on the spawner: docs/runtime.md). A subtree run
            inline needs about depth x (tasks per level) of them.
        sm_fraction: with workers=None, the share of the GPU's SMs the workers take (default all, at
            one program less per SM than fits, which leaves room beside them).
        max_registers: cap on registers per thread (CUDA; the compiler spills past it), e.g. 128 with
            worker_warps=8 so two workers fit on an SM. None: the compiler's choice (up to 255).
        """
        from warploop.runtime import codegen
        if not (workers is None or workers == "fill" or (isinstance(workers, (int, np.integer)) and workers >= 1)):
            raise ValueError(f"workers={workers!r}: use a number of worker programs >= 1, \"fill\" (every slot) "
                             f"or None (the default)")
        if worker_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"worker_warps={worker_warps}: use 1, 2, 4, 8 or 16")
        if max_registers is not None and not (isinstance(max_registers, (int, np.integer))
                                              and 32 <= max_registers <= 255):
            raise ValueError(f"max_registers={max_registers!r}: use a number of registers per thread from 32 to "
                             f"255, or None (the compiler's choice)")
        if park_after_us is not None and not 0 <= park_after_us <= 60e6:
            raise ValueError(f"park_after_us={park_after_us}: use a number of microseconds from 0 to 60e6, or None")
        if sm_fraction is not None and not 0 < sm_fraction <= 1:
            raise ValueError(f"sm_fraction={sm_fraction}: use a fraction in (0, 1], e.g. 0.5 for half the SMs")
        self.info = select_device(device)
        chosen = list(REGISTRY.values()) if tasks is None else [lookup(t) for t in tasks]
        if not chosen:
            raise ValueError("no tasks: decorate Triton functions with @warploop.task before starting a Runtime")
        self.tasks = {t.opcode: t for t in chosen}
        self.names = {t.opcode: t.name for t in chosen} | {OP_EXTERNAL: "external"}
        self.timeout = timeout
        self.module = codegen.build(chosen)
        self._device_type = "cpu" if self.info.target.backend == "cpu" else "cuda"
        self.ports = ports
        if ports is not None and self._device_type != "cpu" and ports.device.type == "cpu" and not ports.is_pinned():
            raise ValueError("ports must be in pinned host memory (warploop.std.allocate_ports) or on the device")
        ports_addr = 0 if ports is None else ports.data_ptr()
        if self.info.target.backend == "cpu":
            from warploop.runtime.cpu import CpuExecutor
            self._backend = CpuExecutor(self.module, None if workers == "fill" else workers, trace, pool, submit_slots,
                                        ports_addr, reserve)
        else:
            from warploop.runtime.gpu import GpuBackend
            park_ns = -1 if park_after_us is None else int(park_after_us * 1000)
            self._backend = GpuBackend(self.info, self.module, workers, worker_warps, trace, pool, submit_slots,
                                       ports_addr, park_ns, sm_fraction, reserve, max_registers)
        self.workers, self.layout = self._backend.workers, self._backend.layout
        self._h = self._backend.host
        self._h64 = self._h.view(np.int64)
        # The submit path reads and writes single words through memoryviews: each access is one
        # aligned 4- or 8-byte load or store (as the self-checking completion words need), and
        # several times cheaper from Python than indexing the numpy views.
        self._w32 = memoryview(self._h).cast("B").cast("i")
        self._w64 = memoryview(self._h).cast("B").cast("q")
        self._hl = self._backend.host_layout
        self._slot_header: list[int | None] = [None] * submit_slots   # opcode whose header each slot holds
        self._futures: list[Future | None] = [None] * submit_slots
        self._ticket = 0
        self._greq = 0
        self._graphs = 0
        self._closed = False      # close() was called: no new work
        self._stopped = False     # close() has returned: nothing unfinished will ever finish
        self._headers = {}
        self._post_lock = threading.Lock()     # submit and complete_external may come from any thread

    # -- context management ----------------------------------------------------------------------
    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(abort=exc_type is not None)

    def park(self, timeout: float | None = None) -> bool:
        """Park the resident kernel now, without waiting out `park_after_us`: once it is idle (no
        task, no graph request in flight) every program exits, so the SMs it held are free for
        other kernels until the next submission relaunches it. Returns once it has exited (True),
        or False where nothing parks (the CPU executor; park_after_us=None). Call it before work
        that needs the whole GPU, such as a large torch kernel."""
        if self._closed:
            raise RuntimeError("this Runtime is closed")
        return self._backend.park(self.timeout if timeout is None else timeout)

    def close(self, timeout: float = 10.0, abort: bool = False) -> None:
        """Stop the resident kernel: let queued work drain (up to `timeout`), then abort."""
        if self._closed:
            return
        self._closed = True
        try:
            self._backend.stop(abort, timeout)
        finally:
            self._stopped = True

    @property
    def backend(self) -> str:
        return self.info.target.backend

    # -- tasks -----------------------------------------------------------------------------------
    def _task(self, task) -> Task:
        t = lookup(task)
        if t.opcode not in self.tasks:
            raise ValueError(f"task {t.name} is not part of this Runtime; pass it in Runtime(tasks=[...])")
        return t

    def _check_arg(self, spec: ArgSpec, value) -> None:
        device = getattr(value, "device", None)
        if device is not None and spec.type.startswith("*") and device.type != self._device_type:
            raise ValueError(f"argument {spec.name!r} is on {device.type}, but this runtime runs on "
                             f"{self._device_type}: move it with .to({self._device_type!r})")

    def submit(self, task, *args) -> Future:
        """Queue `task(*args)` on the resident kernel; returns a Future. No kernel launch."""
        if self._closed:
            raise RuntimeError("this Runtime is closed")
        t = self._task(task)
        if not (args or t.args):       # nothing to encode or check (a no-op's submit is all overhead)
            return self._post(t.opcode, (), t.name)
        slots = t.encode(args)
        for spec, value in zip(t.args, args, strict=True):
            self._check_arg(spec, value)
        return self._post(t.opcode, slots, t.name)

    def submit_descriptor(self, desc: TaskDescriptor) -> Future:
        """Queue a ready-made dynamic descriptor (e.g. for a task compiled elsewhere). Unchecked:
        the device validates it, and a bad one fails its Future, not the runtime."""
        if self._closed:
            raise RuntimeError("this Runtime is closed")
        words = np.array(desc.serialize(), dtype=np.int32)
        return self._post(desc.opcode, words[ARG_WORD:].view(np.int64).tolist(),
                          self.names.get(desc.opcode, "descriptor"), header=words[:ARG_WORD])

    def complete_external(self, handle: int, status: int = 0, result: int = 0) -> None:
        """Complete the external handle `handle` (wl.external) with `status` and `result`, which its
        continuations read with wl.status/wl.result. Safe from any thread (the std server calls it
        from its own); it never runs the CPU executor, so it must not be the thread that drives it.

        The request takes a submit slot but no completion record, so it waits only for the front
        to take that slot's previous descriptor, never for a task: a ring full of tasks that wait
        on host replies still lets their replies through. A bad handle (never issued, not
        external, completed already) is refused on the device: ERR_BAD_HANDLE in status().error.
        """
        if self._closed:
            raise RuntimeError("this Runtime is closed")
        self._post(OP_EXTERNAL, (handle, status, result), "external", task=False)

    def _post(self, opcode: int, slots, name: str, header: np.ndarray | None = None,
              task: bool = True) -> Future | None:
        """Write one descriptor into the next submit slot, sequence word last; a task's Future.

        Ticket t uses submit slot t % S once the front has taken ticket t - S from it, and a task
        also needs completion record t % S, free once the last task that used it is collected.
        Submit and complete_external may come from different threads: a ticket is taken and its
        slot written under a lock, but waiting happens outside it, so a thread that waits (and on
        the CPU runs the executor meanwhile) never blocks another.
        """
        nslots = self._hl.submit_slots
        while True:
            with self._post_lock:
                ticket = self._ticket
                index = ticket % nslots
                previous = self._futures[index] if task else None
                if self._slot_free(ticket, previous):
                    future = None
                    if task:
                        rec = (self._hl.completions + index * L.COMPLETION_WORDS) // 2
                        future = self._futures[index] = Future(self, ticket, name, rec)
                    self._write_slot(index, ticket, opcode, slots, header)
                    self._ticket = ticket + 1
                    break
            ready = lambda t=ticket, p=previous: self._slot_free(t, p)
            if task:
                self._wait(ready, None, f"submit slot {index} to free up")
            else:   # another thread drives the CPU executor (or the GPU runs): only watch
                deadline = time.perf_counter() + self.timeout
                while not ready():
                    if time.perf_counter() > deadline:
                        raise TimeoutError(f"submit slot {index} did not free up in {self.timeout:g} s")
                    self._backend.resume()
                    time.sleep(20e-6)
        # After the lock's release (a full fence): the other half of the park handshake (front.py).
        self._backend.resume()
        return future

    def _slot_free(self, ticket: int, previous: Future | None) -> bool:
        taken = self._w64[L.HB_SUBMIT_HEAD // 2] > ticket - self._hl.submit_slots
        return taken and (previous is None or previous._settled or previous.done())

    def _write_slot(self, index: int, ticket: int, opcode: int, slots, header: np.ndarray | None) -> None:
        base = self._hl.submit + index * L.SUBMIT_SLOT_WORDS
        desc = base + L.SLOT_DESC
        if header is not None:        # a ready-made descriptor: its own header
            self._h[desc:desc + ARG_WORD] = header
            self._slot_header[index] = None
        elif self._slot_header[index] != opcode:
            # TaskDescriptor(opcode).serialize()[:ARG_WORD]; a slot keeps it for its next task of this opcode
            header = self._headers.get(opcode)
            if header is None:
                header = self._headers[opcode] = np.array([opcode, -1, 0, -1, -1, 0, -1, 0], dtype=np.int32)
            self._h[desc:desc + ARG_WORD] = header
            self._slot_header[index] = opcode
        if slots:
            w64, first = self._w64, (desc + ARG_WORD) // 2
            for j, value in enumerate(slots):
                w64[first + j] = value if value < 1 << 63 else value - (1 << 64)
        self._w32[base] = to_i32(ticket + 1)        # last: the front takes the slot once it sees this

    def _settle(self, future: Future) -> None:
        """Settle `future` if its completion record is whole: three words, each with its sequence."""
        w64, rec, seq = self._w64, future._rec, future._seq
        first = w64[rec]
        if first & 0xFFFFFFFF == seq:
            low, high = w64[rec + 1], w64[rec + 2]
            if low & 0xFFFFFFFF == seq and high & 0xFFFFFFFF == seq:
                future._status = first >> 32
                future._value = (high >> 32 << 32) | (low >> 32 & 0xFFFFFFFF)
                future._settled = True

    # -- graphs ----------------------------------------------------------------------------------
    def graph(self) -> Graph:
        """A new static graph on this runtime (see graph.py)."""
        if self._graphs >= self.layout.max_graphs:
            raise RuntimeError(f"at most {self.layout.max_graphs} graphs per Runtime")
        self._graphs += 1
        return Graph(self, self._graphs - 1)

    def _request_graph(self, gid: int, repeat: int, params: list[int]) -> GraphFuture:
        seq = self._greq + 1
        if seq > L.GREQ_SLOTS:
            self._wait(lambda: self._h64[L.HB_GRAPH_DONE // 2] >= seq - L.GREQ_SLOTS, None,
                       "a graph request slot to free up")
        base = self._hl.greq + (self._greq % L.GREQ_SLOTS) * L.GREQ_WORDS
        self._h[base + 1:base + 4] = (gid, repeat, len(params))
        self._h64[(base + 8) // 2:(base + 8) // 2 + len(params)] = params
        self._h[base] = to_i32(seq)
        self._greq = seq
        with self._post_lock:     # a full fence between the sequence word and the park word
            pass
        self._backend.resume()
        return GraphFuture(self, seq)

    # -- waiting, status, trace ------------------------------------------------------------------
    def _wait(self, ready, timeout: float | None, what) -> None:
        """Wait for `ready()`; TimeoutError after `timeout`, RuntimeError once the runtime has stopped
        (close() on another thread ends the wait too: nothing unfinished can finish after it)."""
        if not self._stopped:
            self._backend.wait(lambda: ready() or self._stopped, self.timeout if timeout is None else timeout, what,
                               report=lambda: self.status().describe())
        if not ready():
            raise RuntimeError(f"{what} cannot complete: its Runtime was closed (close()) first")

    def status(self) -> RuntimeStatus:
        """Workers' states, pending tasks and the first device error, from a live snapshot."""
        return read_status(self._backend.snapshot(), self._h, self.layout, self.names)

    def _error_detail(self) -> str:
        err = self.status().error
        if not err:
            return ""
        name = self.names.get(err["opcode"], f"opcode {err['opcode']}")
        return f" (first device error: {err['message']}: {name}, worker {err['worker']})"

    def check(self) -> None:
        """Raise RuntimeFault if the device recorded a fatal error."""
        self._backend.check()

    def save_trace(self, path: str) -> None:
        """Write the recorded task events (Runtime(trace=True)) as Chrome trace JSON."""
        events = self._backend.trace_events()
        if not events and not getattr(self._backend, "trace", False):
            raise RuntimeFault("no trace recorded: create the Runtime with trace=True")
        trace_mod.save(path, events, self.names, label=f"warploop {self.info.target}")
