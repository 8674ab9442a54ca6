"""The GPU backend: compile, size, launch and stop the resident kernel; wait on host-visible words.

The kernel is launched once, cooperatively where the driver supports it, on a stream of its own
(created non-blocking by torch, so default-stream work keeps running beside it), with one front
program plus the workers. It talks to the host only through the pinned host block.

While a runtime is open do not call torch.cuda.synchronize(): it waits for every kernel, and the
resident one runs until close(). Synchronise streams or events instead.
"""
from __future__ import annotations

import time
import weakref
from collections.abc import Callable

import numpy as np

from warploop.runtime import layout as L
from warploop.runtime.errors import RuntimeFault
from warploop.runtime.status import read_error
from warploop.runtime.trace import events_from_buffer
from warploop.target import DeviceInfo

TRACE_CAP = 4096          # events kept per worker
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


def _emergency_stop(host: np.ndarray) -> None:
    host[L.HB_STOP] = L.ABORT


class GpuBackend:
    def __init__(self, info: DeviceInfo, module, workers: int | None, worker_warps: int, trace: bool,
                 pool: int, submit_slots: int, ports_addr: int = 0) -> None:
        import torch
        self.info = info
        self.device = torch.device(info.target.backend if info.target.backend != "hip" else "cuda", 0)
        self.backend = "cuda" if info.target.backend == "cuda" else "hip"
        probe = torch.zeros(L.HEADER_WORDS, dtype=torch.int32, device=self.device)
        opts = dict(INLINE=False, TRACE=trace, BACKEND=self.backend, num_warps=worker_warps,
                    launch_cooperative_grid=True)
        compiled = module.resident.warmup(probe, grid=(1,), **opts)
        per_sm = blocks_per_sm(compiled, worker_warps) if self.backend == "cuda" else 1
        capacity = info.sm_count * per_sm
        if capacity < 2:
            raise RuntimeFault(f"the resident kernel fits {capacity} program(s) on this GPU; it needs a front and "
                               f"a worker: lower worker_warps or simplify the task bodies")
        if workers is None:
            # Leave one program's worth of room per SM (where there is any) for other kernels,
            # which would otherwise queue behind a kernel that never ends.
            density = min(max(1, per_sm - 1), max(1, WARPS_PER_SM // worker_warps))
            workers = info.sm_count * density - 1
        if not 1 <= workers <= capacity - 1:
            raise ValueError(f"workers={workers}: at most {capacity - 1} can be co-resident here "
                             f"({info.sm_count} SMs x {per_sm} programs, one program is the front); "
                             f"spin-waits between workers would deadlock beyond that")
        self.workers, self.per_sm, self.trace = workers, per_sm, trace
        self.layout = L.ArenaLayout(workers=workers, pool=pool, trace_cap=TRACE_CAP if trace else 0,
                                    front_reserve=submit_slots)   # a slot of its own per submit slot
        self.host_layout = L.HostLayout(submit_slots=submit_slots)
        self.host_t = torch.zeros(self.host_layout.words, dtype=torch.int32, pin_memory=True)
        self.host = self.host_t.numpy()
        self.trace_buf = (torch.zeros(workers * TRACE_CAP * L.TRACE_WORDS, dtype=torch.int32, device=self.device)
                          if trace else None)
        words = L.initial_arena(self.layout, self.host_t.data_ptr(),
                                self.trace_buf.data_ptr() if trace else 0, submit_slots, ports_addr)
        self.arena = torch.from_numpy(words).to(self.device)
        self.stream = torch.cuda.Stream(self.device)
        self.side = torch.cuda.Stream(self.device)
        self._finalizer = weakref.finalize(self, _emergency_stop, self.host)
        self.graphs: dict[int, tuple] = {}
        self.programs = workers + 1
        with torch.cuda.stream(self.stream):
            module.resident[(self.programs,)](self.arena, **opts)
        self.wait(lambda: self.host[L.HB_STARTED] == 1, START_TIMEOUT_S, "the resident kernel to start")

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
        if self.host[L.HB_EXITED] and self.host[L.HB_STOP] == L.RUN:
            raise RuntimeFault("the resident kernel exited while the runtime was open")

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
        if self.host[L.HB_EXITED] >= self.programs:
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
