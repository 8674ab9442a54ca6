"""What the runtime is doing, read from a snapshot of its memory: for timeouts and `rt.status()`."""
from __future__ import annotations

import dataclasses

import numpy as np

from warploop.runtime import layout as L
from warploop.runtime.errors import ERR_POOL_FULL, describe


@dataclasses.dataclass(frozen=True)
class WorkerState:
    index: int
    state: str
    task: int      # dynamic task id, -1 if none
    node: int      # graph node, -1 if none
    detail: int    # counter waited on / low word of the handle joined

    def __str__(self) -> str:
        where = f"task {self.task}" if self.task >= 0 else f"graph node {self.node}" if self.node >= 0 else ""
        extra = {"waiting on counter": f" counter {self.detail}",
                 "joining": f" handle {self.detail}"}.get(self.state, "")
        return f"worker {self.index}: {self.state}{extra}" + (f" ({where})" if where and self.state != "idle" else "")


@dataclasses.dataclass(frozen=True)
class PendingTask:
    id: int
    opcode: int
    name: str
    parent: int
    pending: int     # 1 for its own body while it runs, plus one per unfinished child

    def __str__(self) -> str:
        parent = f", parent {self.parent}" if self.parent >= 0 else ""
        return f"task {self.id} {self.name}{parent}, pending count {self.pending}"


@dataclasses.dataclass(frozen=True)
class RuntimeStatus:
    workers: tuple[WorkerState, ...]
    pending: tuple[PendingTask, ...]
    issued: int
    completed: int
    ready: int
    graph_runs: int
    error: dict | None

    def describe(self, limit: int = 12) -> str:
        lines = [f"{self.issued - self.completed} dynamic task(s) alive ({self.ready} ready, "
                 f"{self.completed}/{self.issued} completed), {self.graph_runs} graph run(s) released"]
        lines += [f"  pending: {p}" for p in self.pending[:limit]]
        if len(self.pending) > limit:
            lines.append(f"  ... and {len(self.pending) - limit} more pending")
        # the workers at work first (an exited one holds nothing): with hundreds of workers and a
        # limit of lines, the one joining a task is what a reader needs to see
        busy = sorted((w for w in self.workers if w.state != "idle"), key=lambda w: (w.state == "exited", w.index))
        lines += [f"  {w}" for w in busy[:limit]]
        lines.append(f"  {len(self.workers) - len(busy)} of {len(self.workers)} worker(s) idle")
        if self.error:
            lines.append(f"  device error: {self.error['message']} (opcode {self.error['opcode']}, "
                         f"worker {self.error['worker']})")
        return "\n".join(lines)


def read_error(host: np.ndarray) -> dict | None:
    """The first error the device recorded in the host block, or None."""
    base = L.HB_ERROR
    code = int(host[base + L.E_CODE])
    if code == 0:
        return None
    task = int(host[base + L.E_TASK:base + L.E_TASK + 2].view(np.int64)[0])
    message = describe(code)
    if code == ERR_POOL_FULL:      # detail: the shared pool's size, task: tasks alive at the time
        message = (f"dynamic task pool is full: {task} tasks alive in pool={host[base + L.E_DETAIL]} plus "
                   f"every reserved slot of the spawning worker; raise Runtime(pool=...) or keep fewer tasks "
                   f"alive (spawn trees, not flat loops: docs/runtime.md)")
    return {"code": code, "message": message, "opcode": int(host[base + L.E_OPCODE]),
            "worker": int(host[base + L.E_WORKER]), "detail": int(host[base + L.E_DETAIL]), "task": task,
            "fatal": bool(host[base + L.E_FATAL])}


def read_status(arena: np.ndarray, host: np.ndarray, layout: L.ArenaLayout, names: dict[int, str]) -> RuntimeStatus:
    a64 = arena.view(np.int64)

    def ctl(index: int) -> int:
        return int(a64[layout.ctl_word(index) // 2])

    workers = []
    for w in range(layout.workers):
        base = layout.ctx + w * L.CTX_WORDS
        state = int(arena[base + L.X_STATE])
        workers.append(WorkerState(index=w, state=L.STATE_NAMES[state] if 0 <= state < len(L.STATE_NAMES) else "?",
                                   task=int(a64[(base + L.X_TASK) // 2]), node=int(arena[base + L.X_NODE]),
                                   detail=int(arena[base + L.X_DETAIL])))
    slots = layout.slots
    done = a64[layout.meta64(L.M_DONE) // 2:][:slots]
    issued = a64[layout.meta64(L.M_ISSUED) // 2:][:slots]
    parent = a64[layout.meta64(L.M_PARENT) // 2:][:slots]
    pending_count = arena[layout.meta32(L.M_PENDING):][:slots]
    pending = []
    for slot in np.flatnonzero(done < issued):        # a slot is busy until its last issued task completes
        opcode = int(arena[layout.pool_desc + slot * L.DESC_WORDS])
        pending.append(PendingTask(id=int(issued[slot]), opcode=opcode, name=names.get(opcode, f"opcode {opcode}"),
                                   parent=int(parent[slot]), pending=int(pending_count[slot])))
    pending.sort(key=lambda p: p.id)
    return RuntimeStatus(workers=tuple(workers), pending=tuple(pending), issued=ctl(L.C_NEXT_ID),
                         completed=ctl(L.C_COMPLETED), ready=ctl(L.C_RING_TAIL) - ctl(L.C_RING_HEAD),
                         graph_runs=ctl(L.C_RUN_SEQ), error=read_error(host))
