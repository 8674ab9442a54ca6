"""Static graphs: record tile tasks and their dependencies once, replay them with no launch.

    g = rt.graph()
    x = g.param("x", "*fp32")                        # bound at each run
    tiles = [g.add(gemv, W1, x, h, t) for t in range(8)]
    out = [g.add(gemv, W2, h, y, t, after=tiles) for t in range(8)]
    g.run(x=inputs[0])                               # compiles on first use, then replays
    g.run(x=inputs[1])

A node may name memory it will read that no predecessor writes (its weights): `prefetch=` up to
two tensors or (address, bytes) ranges. The worker that runs the node `prefetch_ahead` places
earlier on its list pulls them into L2 as it starts that earlier node, so memory keeps streaming
while the worker waits, reduces and signals (layout.INST_WORDS).

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
    prefetch: tuple[tuple[int, int], ...] = ()


def prefetch_ranges(prefetch) -> tuple[tuple[int, int], ...]:
    """Graph.add's `prefetch`: tensors or (address, bytes) pairs, as (address, bytes) pairs."""
    out = []
    for r in prefetch or ():
        if hasattr(r, "data_ptr"):
            r = (r.data_ptr(), r.numel() * r.element_size())
        if (not isinstance(r, tuple) or len(r) != 2 or not all(isinstance(v, int) and not isinstance(v, bool)
                                                              for v in r)):
            raise TypeError(f"prefetch: each range is a tensor or an (address, bytes) pair of ints, got {r!r}")
        if r[0] <= 0 or not 0 < r[1] < 2**31:
            raise ValueError(f"prefetch: range {r!r} needs an address > 0 and 1 to 2**31 - 1 bytes")
        out.append(r)
    if len(out) > L.PREFETCH_RANGES:
        raise ValueError(f"prefetch: at most {L.PREFETCH_RANGES} ranges a node, got {len(out)}")
    return tuple(out)


class Graph:
    def __init__(self, runtime, gid: int, prefetch_ahead: int = 1) -> None:
        if not isinstance(prefetch_ahead, int) or not 0 <= prefetch_ahead <= 8:
            raise ValueError(f"prefetch_ahead={prefetch_ahead!r}: use 0 (no prefetch) to 8 instructions")
        self.runtime, self.gid, self.prefetch_ahead = runtime, gid, prefetch_ahead
        self.nodes: list[Node] = []
        self.params: dict[str, Param] = {}
        self.schedule: Schedule | None = None
        self._tensors = None

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

    def add(self, task, *args, after=(), worker: int | None = None, cost: float | None = None,
            prefetch=()) -> Node:
        """Record `task(*args)` running after the nodes in `after`; returns its node. `prefetch`:
        up to two tensors or (address, bytes) ranges the node reads that no node writes (see above)."""
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
        deps = tuple(sorted({n.index if isinstance(n, Node) else int(n) for n in (after or ())}))
        node = Node(len(self.nodes), t, tuple(args), deps, t.cost if cost is None else float(cost), worker,
                    prefetch_ranges(prefetch))
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

    def prefetch_words(self) -> np.ndarray:
        """Each instruction's prefetch words (layout.I_PREFETCH on), in descriptors() order: the
        ranges of the node `prefetch_ahead` instructions later on the same worker."""
        rows = []
        for insts in self.schedule.lists:
            for k in range(len(insts)):
                row = [0] * (L.INST_WORDS - L.I_PREFETCH)
                later = k + self.prefetch_ahead
                if self.prefetch_ahead and later < len(insts) and insts[later].node >= 0:
                    for j, (address, nbytes) in enumerate(self.nodes[insts[later].node].prefetch):
                        row[4 * j:4 * j + 4] = [*split64(address), *split64(nbytes)]
                rows.append(row)
        return np.array(rows, dtype=np.int64).reshape(-1, L.INST_WORDS - L.I_PREFETCH)

    def compile(self) -> Schedule:
        if self._tensors is not None:
            return self.schedule
        import torch
        rt, backend = self.runtime, self.runtime._backend
        descs, table = self.descriptors()
        words = np.zeros((max(1, len(descs)), L.INST_WORDS), dtype=np.int32)
        if descs:
            words[:, :DESC_WORDS] = [d.serialize() for d in descs]
            words[:, L.I_PREFETCH:] = self.prefetch_words()
        words = words.reshape(-1)
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

