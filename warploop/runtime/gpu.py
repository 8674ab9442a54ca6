"""The GPU backend: compile, size, launch, park, relaunch and stop the resident kernel; wait on
host-visible words.

The kernel is launched cooperatively where the driver supports it, on a stream of its own (created
non-blocking by torch, so default-stream work keeps running beside it), with one front program plus
the workers. It talks to the host only through the pinned host block.

Parking (docs/runtime.md): CUDA work that synchronises the whole context (loading a module on first
use, the RNG's set-up, cudaFree, torch.cuda.synchronize()) waits for every running kernel, and a
resident one would never end. So once the runtime has been idle for park_after_us the front parks
it: every program exits with its state kept in the arena, and `resume` launches it again when work
arrives. Such CUDA work therefore waits only until the runtime is idle.
"""
from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable

import numpy as np

from warploop.runtime import layout as L
from warploop.runtime.errors import RuntimeFault
from warploop.runtime.status import read_error
from warploop.runtime.trace import events_from_buffer
from warploop.target import DeviceInfo

TRACE_CAP = 8192          # events kept per worker
START_TIMEOUT_S = 60.0
WARPS_PER_SM = 16         # default worker density: 4 workers of 4 warps, 16 of 1 warp, per SM


def blocks_per_sm(kernel, num_warps: int) -> int:
    """How many programs of `kernel` fit on one SM at once (the driver's occupancy calculator)."""
    kernel._init_handles()
    from cuda.bindings import driver as cu
    err, n = cu.cuOccupancyMaxActiveBlocksPerMultiprocessor(cu.CUfunction(kernel.function), 32 * num_warps,
                                                           kernel.metadata.shared)
    if err != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeFault(f"occupancy query failed: {err}")
    return int(n)


def torch_stream(stream):
    import torch
    return torch.cuda.stream(stream)


def _backoff(start: float, timeout: float, what: str) -> None:
    """Between polls of a short wait: spin for 200 us (a sleep costs ~60 us of timer slack), then sleep."""
    elapsed = time.perf_counter() - start
    if elapsed > timeout:
        raise RuntimeFault(what)
    if elapsed > 200e-6:
        time.sleep(20e-6)


def _emergency_stop(host: np.ndarray) -> None:
    host[L.HB_STOP] = L.ABORT


def compile_resident(module, device, backend: str, worker_warps: int, trace: bool, max_registers: int | None = None):
    """(compiled kernel, launch options) of the resident kernel of `module` (codegen.build): compiled
    here or found in Triton's cache, without launching anything. The megakernel's probes call it
    in parallel processes to fill the cache before timing. max_registers caps the registers a
    thread may use (CUDA: ptxas spills the rest), so more programs fit on an SM."""
    import torch

    from warploop.runtime.portable_cache import keyed
    probe = torch.zeros(L.HEADER_WORDS, dtype=torch.int32, device=device)
    opts = dict(INLINE=False, TRACE=trace, BACKEND=backend, num_warps=worker_warps, launch_cooperative_grid=True)
    if max_registers is not None and backend == "cuda":
        opts["maxnreg"] = max_registers
    with keyed():       # WARPLOOP_PORTABLE_CACHE: a binary compiled without a GPU is found (portable_cache.py)
        return module.resident.warmup(probe, grid=(1,), **opts), opts


class GpuBackend:
    def __init__(self, info: DeviceInfo, module, workers: int | str | None, worker_warps: int, trace: bool,
                 pool: int, submit_slots: int, ports_addr: int = 0, park_ns: int = -1,
                 sm_fraction: float | None = None, reserve: int = L.ArenaLayout.reserve,
                 max_registers: int | None = None) -> None:
        import torch
        self.info = info
        self.device = torch.device(info.target.backend if info.target.backend != "hip" else "cuda", 0)
        self.backend = "cuda" if info.target.backend == "cuda" else "hip"
        compiled, opts = compile_resident(module, self.device, self.backend, worker_warps, trace, max_registers)
        per_sm = blocks_per_sm(compiled, worker_warps) if self.backend == "cuda" else 1
        capacity = info.sm_count * per_sm
        if capacity < 2:
            raise RuntimeFault(f"the resident kernel fits {capacity} program(s) on this GPU; it needs a front and "
                               f"a worker: lower worker_warps or simplify the task bodies")
        if workers == "fill":
            workers = capacity - 1
        elif workers is None:
            # Leave one program's worth of room per SM (where there is any) for other kernels,
            # which would otherwise queue behind a kernel that never ends.
            density = min(max(1, per_sm - 1), max(1, WARPS_PER_SM // worker_warps))
            sms = info.sm_count if sm_fraction is None else max(1, round(info.sm_count * sm_fraction))
            workers = max(1, sms * density - 1)
        if not 1 <= workers <= capacity - 1:
            raise ValueError(f"workers={workers}: at most {capacity - 1} can be co-resident here "
                             f"({info.sm_count} SMs x {per_sm} programs, one program is the front); "
                             f"spin-waits between workers would deadlock beyond that")
        self.workers, self.per_sm, self.trace = workers, per_sm, trace
        self.layout = L.ArenaLayout(workers=workers, pool=pool, trace_cap=TRACE_CAP if trace else 0,
                                    reserve=reserve, front_reserve=submit_slots)   # a slot of its own per submit slot
        self.host_layout = L.HostLayout(submit_slots=submit_slots)
        self.host_t = torch.zeros(self.host_layout.words, dtype=torch.int32, pin_memory=True)
        self.host = self.host_t.numpy()
        self.trace_buf = (torch.zeros(workers * TRACE_CAP * L.TRACE_WORDS, dtype=torch.int32, device=self.device)
                          if trace else None)
        words = L.initial_arena(self.layout, self.host_t.data_ptr(),
                                self.trace_buf.data_ptr() if trace else 0, submit_slots, ports_addr, park_ns)
        self.park_ns = park_ns
        self.arena = torch.from_numpy(words).to(self.device)
        self.stream = torch.cuda.Stream(self.device)
        self.side = torch.cuda.Stream(self.device)
        self._finalizer = weakref.finalize(self, _emergency_stop, self.host)
        self.graphs: dict[int, tuple] = {}
        self.programs = workers + 1
        self.relaunches = 0
        self.last_resume_us = 0.0       # host time of the last relaunch (exit wait, resets, launch)
        self._kernel, self._opts = module.resident, opts
        # What a relaunch writes into the arena first (stop word back to RUN, no program exited), as
        # copies ordered before the launch on the kernel's own stream: no host wait.
        self._reset_words = torch.zeros(2, dtype=torch.int64, pin_memory=True)
        self._ctl64 = self.arena.view(torch.int64)
        self._resume_lock = threading.Lock()
        self._launch()
        self.wait(lambda: self.host[L.HB_STARTED] == 1, START_TIMEOUT_S, "the resident kernel to start")

    def _launch(self) -> None:
        import torch
        with torch.cuda.stream(self.stream):
            self._kernel[(self.programs,)](self.arena, **self._opts)
            self._ended = torch.cuda.Event()
            self._ended.record(self.stream)

    # -- parking ---------------------------------------------------------------------------------
    def parked(self) -> bool:
        """Whether the kernel has parked (or is parking): it runs nothing until resume()."""
        return bool(self.host[L.HB_PARK] & 1)

    def park(self, timeout: float) -> bool:
        """Ask the front to park at its next idle round and wait until every program has exited
        (the grid has ended), so kernels that need the SMs it held can start. False where the
        kernel never parks (park_after_us=None)."""
        if self.park_ns < 0:
            return False
        start = time.perf_counter()
        self.host[L.HB_PARK_NOW] = 1
        try:
            while not (self.host[L.HB_PARK] & 1 and self.host[L.HB_EXITED] >= self.programs
                       and self._ended.query()):
                if self.host[L.HB_STOP] != L.RUN:
                    return False
                _backoff(start, timeout, "the resident kernel was asked to park but did not (is work still queued?)")
        finally:
            self.host[L.HB_PARK_NOW] = 0
        return True

    def resume(self, timeout: float = START_TIMEOUT_S) -> None:
        """Launch the kernel again if it parked (no-op while it runs): called after every submit
        and graph request, and by every host wait, so work never waits on a parked kernel."""
        if not self.host[L.HB_PARK] & 1:
            return
        with self._resume_lock:
            gen = int(self.host[L.HB_PARK])
            if not gen & 1 or self.host[L.HB_STOP] == L.ABORT:
                return
            start = time.perf_counter()
            # The front either commits (every program exits) or cancels (an even generation).
            while self.host[L.HB_EXITED] < self.programs:
                if self.host[L.HB_PARK] != gen:
                    return
                _backoff(start, timeout, "the resident kernel began to park but did not exit")
            while not self._ended.query():      # the grid itself has ended (an event, not a device sync)
                _backoff(start, timeout, "the parked resident kernel did not end")
            with torch_stream(self.stream):
                for index in (L.C_STOP, L.C_EXITED):
                    word = self.layout.ctl_word(index) // 2
                    self._ctl64[word:word + 1].copy_(self._reset_words[:1], non_blocking=True)
            # Landed before the launch, not only ordered before it: the exit-while-open fault (seen
            # on an H100 on 2026-11-25 at the first decode after a prefill parked the kernel) looked
            # like a relaunched kernel that read the old exit words. 1,600 relaunches showed no fault
            # with or without this sync; it stays, since a relaunch already costs about 100 us of host work.
            self.stream.synchronize()
            self.host[L.HB_EXITED] = 0
            self.host[L.HB_PARK] = gen + 1
            self._launch()
            self.relaunches += 1
            self.last_resume_us = (time.perf_counter() - start) * 1e6

    # -- waiting ---------------------------------------------------------------------------------
    def wait(self, ready: Callable[[], bool], timeout: float | None, what: str,
             report: Callable[[], str] | None = None) -> None:
        """Poll `ready` (host-visible words only): spin first, then back off to short sleeps."""
        if ready():
            return
        start = time.perf_counter()
        deadline = None if timeout is None else start + timeout
        spins = 0
        while not ready():
            spins += 1
            if spins & 63 == 0:
                now = time.perf_counter()
                self.resume()
                self.check()
                if deadline is not None and now > deadline:
                    detail = report() if report else ""
                    raise TimeoutError(f"timed out after {timeout:g} s waiting for {what}\n{detail}".rstrip())
                if now - start > 1e-3:
                    time.sleep(50e-6)

    def check(self) -> None:
        """Raise if the device recorded a fatal error or the kernel ended on its own."""
        err = read_error(self.host)
        if err and err["fatal"]:
            raise RuntimeFault(f"resident kernel fault: {err['message']} (opcode {err['opcode']}, "
                               f"worker {err['worker']}, node/detail {err['detail']})")
        if self.host[L.HB_EXITED] and self.host[L.HB_STOP] == L.RUN and not self.host[L.HB_PARK] & 1:
            # The words as read now, and the grid's own state: evidence for a report (seen once, on
            # an H100, 2026-11-25, at the first decode after a prefill had parked the kernel).
            words = {name: int(self.host[getattr(L, name)]) for name in ("HB_EXITED", "HB_STOP", "HB_PARK",
                                                                          "HB_PARK_NOW", "HB_STARTED")}
            ended = self._ended.query()
            ctl = {}
            if ended:       # nothing runs: the arena's own stop and exit words, as the kernel left them
                a64 = self.snapshot().view(np.int64)
                ctl = {name: int(a64[self.layout.ctl_word(getattr(L, name)) // 2])
                       for name in ("C_STOP", "C_EXITED", "C_PARK_SEQ", "C_RUN_SEQ")}
            raise RuntimeFault(f"the resident kernel exited while the runtime was open ({words}, {ctl}, "
                               f"{self.programs} programs, {self.relaunches} relaunches, grid ended: {ended})")

    # -- memory ----------------------------------------------------------------------------------
    def snapshot(self) -> np.ndarray:
        """A copy of the arena, read on a side stream while the kernel keeps running."""
        import torch
        with torch.cuda.stream(self.side):
            out = self.arena.to("cpu")
        return out.numpy()

    def empty(self, n: int, dtype):
        """Zeroed device memory, written by a copy: a fill kernel might find no free SM."""
        import torch
        out = torch.empty(n, dtype=dtype, device=self.device)
        self.upload(out, np.zeros(n, dtype=torch.empty(0, dtype=dtype).numpy().dtype))
        return out

    def upload(self, dst, src: np.ndarray) -> None:
        import torch
        with torch.cuda.stream(self.side):
            dst.copy_(torch.from_numpy(np.ascontiguousarray(src)), non_blocking=False)
        self.side.synchronize()

    def write_arena(self, offset: int, words: np.ndarray) -> None:
        self.upload(self.arena[offset:offset + len(words)], words.astype(np.int32))

    def register_graph(self, gid: int, insts, table, counters) -> None:
        # The arena's graph table points at these tensors: keep them alive as long as the kernel.
        self.graphs[gid] = (insts, table, counters)

    def trace_events(self) -> list[tuple[int, int, int, int, int]]:
        if self.trace_buf is None:
            return []
        import torch
        with torch.cuda.stream(self.side):
            words = self.trace_buf.to("cpu").numpy()
        return events_from_buffer(words, self.snapshot(), self.layout)

    # -- stopping --------------------------------------------------------------------------------
    def stop(self, abort: bool, timeout: float) -> None:
        if not abort:
            self.resume()        # a parked kernel may still have queued submissions to drain
        if self.host[L.HB_EXITED] >= self.programs and not self.parked():
            self._finalizer.detach()
            return
        if not abort:
            self.host[L.HB_STOP] = L.DRAIN
            try:
                self.wait(lambda: self.host[L.HB_EXITED] >= self.programs, timeout, "the runtime to drain")
            except (TimeoutError, RuntimeFault):
                abort = True
        if abort:
            self.host[L.HB_STOP] = L.ABORT
            deadline = time.perf_counter() + max(timeout, 5.0)
            while self.host[L.HB_EXITED] < self.programs:
                if time.perf_counter() > deadline:
                    raise RuntimeFault("the resident kernel did not stop after abort: a task body loops without "
                                       "a runtime wait; this GPU context is unusable, restart the process")
                time.sleep(1e-4)
        self.stream.synchronize()
        self._finalizer.detach()
