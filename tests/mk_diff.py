"""A diff test for the decode graph: run its nodes on one runtime (a GPU's) and the same nodes, on
CPU copies of every tensor they touch, on the CPU executor; then compare every tensor.

The nodes are transplanted: recorded again with the same tasks, arguments and edges on another
runtime (or the same one, with every node pinned to one worker), so a difference points at one
of three things: a task's code on that device (one node alone), a race between workers (the
whole graph differs across workers but not on one), or the device's rounding (small everywhere).
"""
from __future__ import annotations

import hashlib

import torch

from warploop.llm.mk.graph import DecodeGraph
from warploop.llm.mk.layout import RowSampling, StepInputs
from warploop.runtime.graph import Param


def transplant(rt, nodes, values: dict | None = None, worker: int | None = None):
    """Record `nodes` (graph Nodes, in order) as a new graph on `rt`, tensors swapped through
    `values` ({data_ptr: tensor}), edges kept among the nodes taken; the step inputs stay the
    graph parameter `inp`."""
    g = rt.graph()
    inp = g.param("inp", "*i32")
    made = {}
    for node in nodes:
        args = [inp if isinstance(a, Param) else (values or {}).get(a.data_ptr(), a) if torch.is_tensor(a) else a
                for a in node.args]
        made[node.index] = g.add(node.task, *args, after=[made[d] for d in node.deps if d in made], cost=node.cost,
                                 worker=worker)
    return g


def cpu_copies(nodes, extra=()) -> tuple[dict, dict]:
    """({data_ptr: the device tensor}, {data_ptr: a CPU copy}) for every tensor the nodes take."""
    device = {}
    for t in [a for n in nodes for a in n.args if torch.is_tensor(a)] + list(extra):
        device.setdefault(t.data_ptr(), t)
    return device, {p: t.detach().to("cpu", copy=True) for p, t in device.items()}


def names(mk, dg: DecodeGraph) -> dict[int, str]:
    out = {getattr(dg.buffers, f).data_ptr(): f for f in dg.buffers.__dataclass_fields__}
    for i in range(mk.config.num_layers):
        out[mk.kv[i, 0].data_ptr()], out[mk.kv[i, 1].data_ptr()] = f"k cache {i}", f"v cache {i}"
    return out


def prime(mk, dg: DecodeGraph, contexts: list[int], seed: int = 0) -> None:
    """Random activations and KV cache, and step inputs for len(contexts) sequences whose block
    tables are scattered over the pool (every tensor a node may read holds data, not zeros)."""
    gen = torch.Generator().manual_seed(seed)
    for f in ("res", "qkv", "attn", "act", "parts", "lse", "logits"):
        t = getattr(dg.buffers, f)
        t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))
    mk.kv.copy_(torch.randn(mk.kv.shape, generator=gen).to(mk.kv.dtype))
    for f in ("fstat", "istat", "tokens"):      # the sampling's outputs: one start whatever ran before
        getattr(dg.buffers, f).zero_()
    bs = mk.layout.block_size
    order = torch.randperm(mk.layout.num_blocks, generator=gen).tolist()
    tables = []
    for ctx in contexts:
        need = -(-ctx // bs)
        tables.append(tuple(order[:need]))
        order = order[need:]
    ids = torch.randint(0, mk.config.vocab_size, (len(contexts),), generator=gen).tolist()
    positions = [c - 1 for c in contexts]
    slots = [t[p // bs] * bs + p % bs for t, p in zip(tables, positions, strict=True)]
    # every sampling path, one per row in turn: top-k with a repetition penalty, greedy, the race over
    # the whole vocabulary, top-p (which may leave the row to the host: -1, on both sides alike)
    kinds = [RowSampling(0.8, top_k=8, repetition_penalty=1.3, seed=5, counter=3), RowSampling(),
             RowSampling(1.1, seed=6, counter=3), RowSampling(1.0, top_p=0.9, seed=7, counter=3)]
    sampling = tuple(kinds[i % 4] for i in range(len(contexts)))
    history = tuple(tuple(sorted(set(ids + [3, 77]))) if i % 4 == 0 else () for i in range(len(contexts)))
    words = StepInputs(dg.batch, dg.width, tuple(ids), tuple(positions), tuple(contexts), tuple(slots),
                       tuple(tables), sampling, history, dg.history_width).serialize()
    dg.buffers.inp.copy_(torch.from_numpy(words))


def diff(mk, dg: DecodeGraph, cpu_rt, nodes, worker: int | None = None, timeout: float = 120.0,
         reference: dict | None = None) -> dict[str, float]:
    """Run `nodes` of `dg` on mk's runtime and on `cpu_rt` from the same state; the largest
    difference of each tensor relative to its largest finite value, by name (weights: 0).

    reference: a cache of the CPU side's results, by the nodes (tasks, edges, scalar arguments) and
    every byte of the state they start from, for diffs that differ only in the device side's
    placement (the CPU executor runs one fixed order: the same start gives the same result)."""
    inp = dg.buffers.inp
    device, host = cpu_copies(nodes, extra=[inp])
    key = None
    if reference is not None:
        state = hashlib.sha256(repr([(n.index, n.task.name, n.deps, [a for a in n.args if not torch.is_tensor(a)])
                                     for n in nodes]).encode())
        for p, t in host.items():
            state.update(p.to_bytes(8, "little") + t.contiguous().view(torch.uint8).numpy().tobytes())
        key = state.hexdigest()
    mk._use(dg)      # noqa: SLF001 (the graph's own kernel runs; the backend's other one parks)
    transplant(dg.graph.runtime, nodes, worker=worker).run(inp=inp, timeout=timeout)
    if key in (reference or {}):
        host = reference[key]
    else:
        transplant(cpu_rt, nodes, host).run(inp=host[inp.data_ptr()], timeout=timeout)
        if reference is not None:
            reference[key] = {p: t.clone() for p, t in host.items()}
    label = names(mk, dg)
    out = {}
    for p, t in device.items():
        got, want = t.detach().cpu().float(), host[p].float()
        err = torch.where(got == want, 0.0, (got - want).abs())     # equal infinities (empty splits' lse) agree
        scale = float(want[want.isfinite()].abs().max()) if want.numel() else 1.0
        out[label.get(p, f"tensor@{p:#x}")] = float(err.max()) / (scale or 1.0)
    return out
