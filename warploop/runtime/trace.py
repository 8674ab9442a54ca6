"""Chrome trace JSON (opened by Perfetto and chrome://tracing) from per-worker task events.

An event is (start_ns, end_ns, opcode, worker, ident): ident is the dynamic task id, or the
graph node for static-graph instructions. On the GPU the clock is the global timer, written by
each worker into its own ring of `trace_cap` events (the newest are kept); on the CPU executor it
is the host clock around each interpreted step.
"""
from __future__ import annotations

import json

import numpy as np

from warploop.runtime import layout as L

Event = tuple[int, int, int, int, int]


def events_from_buffer(words: np.ndarray, arena: np.ndarray, layout: L.ArenaLayout) -> list[Event]:
    """Decode the device trace rings; `arena` supplies each worker's event count."""
    cap = layout.trace_cap
    events = []
    for w in range(layout.workers):
        count = int(arena[layout.ctx + w * L.CTX_WORDS + L.X_TRACE])
        for n in range(max(0, count - cap), count):
            ev = words[(w * cap + n % cap) * L.TRACE_WORDS:][:L.TRACE_WORDS]
            start, end = ev[0:2].view(np.int64)[0], ev[2:4].view(np.int64)[0]
            events.append((int(start), int(end), int(ev[4]), int(ev[5]), int(ev[6:8].view(np.int64)[0])))
    return events


def chrome_trace(events: list[Event], names: dict[int, str], label: str = "warploop") -> dict:
    """Events -> a Chrome trace document: one thread per worker, times in microseconds."""
    if not events:
        return {"traceEvents": [], "displayTimeUnit": "ns"}
    origin = min(e[0] for e in events)
    out = [{"ph": "M", "name": "process_name", "pid": 0, "args": {"name": label}}]
    for worker in sorted({e[3] for e in events}):
        out.append({"ph": "M", "name": "thread_name", "pid": 0, "tid": worker, "args": {"name": f"worker {worker}"}})
    for start, end, opcode, worker, ident in sorted(events):
        name = "nop" if opcode == 0 else names.get(opcode, f"opcode {opcode}").rsplit(".", 1)[-1]
        out.append({"ph": "X", "name": name, "pid": 0, "tid": worker, "ts": (start - origin) / 1e3,
                    "dur": max(end - start, 0) / 1e3, "args": {"id": ident, "opcode": opcode}})
    return {"traceEvents": out, "displayTimeUnit": "ns"}


def save(path: str, events: list[Event], names: dict[int, str], label: str = "warploop") -> None:
    with open(path, "w") as f:
        json.dump(chrome_trace(events, names, label), f)
