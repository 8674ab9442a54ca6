"""Static graphs: record tile tasks and their dependencies once, replay them with no launch.

    g = rt.graph()
    x = g.param("x", "*fp32")                        # bound at each run
    tiles = [g.add(gemv, W1, x, h, t) for t in range(8)]
    out = [g.add(gemv, W2, h, y, t, after=tiles) for t in range(8)]
    g.run(x=inputs[0])                               # compiles on first use, then replays
    g.run(x=inputs[1])

Dependencies are between nodes (tiles), not whole operations. Compilation places nodes on
workers and builds counters (placement.py); the instruction lists, counters and parameter block
are uploaded once. A run is one request in the host block: the front copies the parameters and
releases it; workers run their lists, waiting on counters; the front reports when all are done.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from warploop.runtime import layout as L
from warploop.runtime.descriptor import DESC_WORDS, TaskDescriptor, split64
from warploop.runtime.placement import NodeSpec, Schedule, place
from warploop.runtime.tasks import ArgSpec, Task, encode_value


@dataclasses.dataclass(frozen=True)
class Param:
    name: str
    type: str
    index: int


@dataclasses.dataclass(frozen=True)
class Node:
    index: int
    task: Task
    args: tuple
    deps: tuple[int, ...]
    cost: float
    worker: int | None


class Graph:
    def __init__(self, runtime, gid: int) -> None:
        self.runtime, self.gid = runtime, gid
        self.nodes: list[Node] = []
        self.params: dict[str, Param] = {}
        self.schedule: Schedule | None = None
        self._tensors = None
        self._last_after: tuple = (None, ())     # add's last `after` and its deps (holding it keeps its id)

    # -- recording -------------------------------------------------------------------------------
    def param(self, name: str, type: str) -> Param:
        """A run-time argument: pass `name=value` to run()/launch(). Any task argument type."""
        self._mutable()
        if name in self.params:
            raise ValueError(f"parameter {name!r} declared twice")
        if len(self.params) >= L.MAX_PARAMS:
            raise ValueError(f"a graph takes at most {L.MAX_PARAMS} parameters")
        ArgSpec(name, type)
        p = self.params[name] = Param(name, type, len(self.params))
        return p

    def add(self, task, *args, after=(), worker: int | None = None, cost: float | None = None) -> Node:
        """Record `task(*args)` running after the nodes in `after`; returns its node."""
        self._mutable()
        t = self.runtime._task(task)
        if len(args) != len(t.args):
            raise TypeError(f"task {t.name} takes {len(t.args)} arguments, got {len(args)}")
        for spec, value in zip(t.args, args, strict=True):
            if isinstance(value, Param) and value.type != spec.type:
                raise TypeError(f"parameter {value.name!r} is {value.type}, but {t.name} argument "
                                f"{spec.name!r} is {spec.type}")
            if not isinstance(value, Param):
                self.runtime._check_arg(spec, value)
        if type(after) is tuple and after is self._last_after[0]:
            deps = self._last_after[1]          # the tiles of one stage: one tuple of thousands of nodes, once
        else:
            deps = tuple(sorted({n.index if isinstance(n, Node) else int(n) for n in (after or ())}))
            self._last_after = (after, deps)
        node = Node(len(self.nodes), t, tuple(args), deps, t.cost if cost is None else float(cost), worker)
        self.nodes.append(node)
        return node

    def _mutable(self) -> None:
        if self.schedule is not None:
            raise RuntimeError("this graph is compiled (it has run); record a new graph to change it")

    # -- compiling -------------------------------------------------------------------------------
    def descriptors(self) -> tuple[list[TaskDescriptor], np.ndarray]:
        """Compile: the instruction descriptors in worker order, and the (first, count) table."""
        rt = self.runtime
        self.schedule = self.schedule or place([NodeSpec(n.deps, n.cost, n.worker) for n in self.nodes],
                                               rt.workers)
        descs, table = [], np.zeros(2 * rt.workers, dtype=np.int32)
        for w, insts in enumerate(self.schedule.lists):
            table[2 * w:2 * w + 2] = (len(descs), len(insts))
            for inst in insts:
                if inst.node < 0:
                    descs.append(TaskDescriptor(0, waits=inst.waits))
                    continue
                node = self.nodes[inst.node]
                mask, slots = 0, []
                for j, (spec, value) in enumerate(zip(node.task.args, node.args, strict=True)):
                    if isinstance(value, Param):
                        mask |= 1 << j
                        slots.append(value.index)
                    else:
                        slots.append(encode_value(spec, value))
                descs.append(TaskDescriptor(node.task.opcode, tuple(slots), node=inst.node, param_mask=mask,
                                            signal=inst.signal, waits=inst.waits))
        return descs, table

    def compile(self) -> Schedule:
        if self._tensors is not None:
            return self.schedule
        import torch
        rt, backend = self.runtime, self.runtime._backend
        descs, table = self.descriptors()
        words = np.array([w for d in descs for w in d.serialize()] or [0] * DESC_WORDS, dtype=np.int32)
        insts = backend.empty(len(words), torch.int32)
        backend.upload(insts, words)
        table_t = backend.empty(len(table), torch.int32)
        backend.upload(table_t, table)
        counters = backend.empty(max(1, len(self.schedule.counter_sizes)), torch.int64)
        params = backend.empty(L.MAX_PARAMS, torch.int64)
        entry = np.zeros(L.GRAPH_WORDS, dtype=np.int32)
        for field, tensor in ((L.G_INSTS, insts), (L.G_WORKER_TABLE, table_t), (L.G_COUNTERS, counters),
                              (L.G_PARAMS, params)):
            entry[field:field + 2] = split64(tensor.data_ptr())
        entry[L.G_NINST], entry[L.G_NCOUNTERS], entry[L.G_NPARAMS] = len(descs), len(self.schedule.counter_sizes), \
            len(self.params)
        backend.register_graph(self.gid, insts, table_t, counters)
        backend.write_arena(rt.layout.graphs + self.gid * L.GRAPH_WORDS, entry)
        self._tensors = (insts, table_t, counters, params)
        return self.schedule

    def halt_address(self) -> int:
        """The address of this graph's halt word (int32, device memory), for a node that ends its
        request early: pass it as a `*i32` argument and store a nonzero value; the front then
        releases no further repeat once the run in flight has finished (the request reports done).
        The front clears the word when it starts each request."""
        rt = self.runtime
        return rt._backend.arena.data_ptr() + 4 * (rt.layout.graphs + self.gid * L.GRAPH_WORDS + L.G_HALT)

    # -- running ---------------------------------------------------------------------------------
    def launch(self, repeat: int = 1, **values):
        """Queue `repeat` runs with these parameter values; returns a future (no kernel launch)."""
        if repeat < 1:
            raise ValueError(f"repeat must be >= 1, got {repeat}")
        missing = set(self.params) - set(values)
        unknown = set(values) - set(self.params)
        if missing or unknown:
            raise TypeError(f"graph parameters: missing {sorted(missing)}, unknown {sorted(unknown)}")
        self.compile()
        encoded = [0] * len(self.params)
        for name, p in self.params.items():
            spec = ArgSpec(name, p.type)
            self.runtime._check_arg(spec, values[name])
            encoded[p.index] = encode_value(spec, values[name])
        return self.runtime._request_graph(self.gid, repeat, encoded)

    def run(self, repeat: int = 1, timeout: float | None = None, **values) -> None:
        """Run (or replay) the graph and wait for it."""
        self.launch(repeat, **values).result(timeout)

    def __len__(self) -> int:
        return len(self.nodes)

