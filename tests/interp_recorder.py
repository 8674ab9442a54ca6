"""Record, per graph node, which elements of a decode graph's buffers and KV cache the Triton
interpreter loads and stores while the CPU executor runs the graph (tests/test_mk_hazards.py)."""
from __future__ import annotations

import collections
import contextlib

import numpy as np
from triton.runtime import interpreter

from warploop.runtime import layout as L
from warploop.runtime.cpu import CpuExecutor
from warploop.runtime.descriptor import DESC_WORDS


def regions(mk, dg) -> list[tuple[int, int, int, int, bool]]:
    """(base address, end address, element size, row width, rows are batch rows) of every buffer a
    graph node may write: the step buffers (all but the step inputs) and each layer's K and V cache
    (whose rows are slots: -1 is recorded for them)."""
    cfg, b = mk.config, dg.buffers
    heads, splits, hd = cfg.num_heads, mk.plan.splits, cfg.head_dim
    widths = {"res": cfg.hidden_size, "qkv": cfg.q_size + 2 * cfg.kv_size, "attn": cfg.q_size,
              "act": cfg.intermediate_size, "parts": heads * splits * hd, "lse": heads * splits,
              "logits": cfg.vocab_size, "tokens": 1, "fstat": b.fstat.shape[1] * 3,
              "istat": b.istat.shape[1] * b.istat.shape[2], "loop": b.loop.numel()}
    tensors = [(getattr(b, name), width, True) for name, width in widths.items()]
    tensors += [(mk.kv[i, j], cfg.kv_size, False) for i in range(cfg.num_layers) for j in range(2)]
    return [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), t.element_size(), w, rows)
            for t, w, rows in tensors]


@contextlib.contextmanager
def recorded_accesses(mk, dg):
    """Yields {node of dg: {(buffer base, is_write, column, row)}}, filled while the block runs steps
    of dg (row -1 in the KV cache)."""
    log: dict[int, set] = collections.defaultdict(set)
    current = {"node": None}
    load, store = interpreter.InterpreterBuilder.create_masked_load, interpreter.InterpreterBuilder.create_masked_store
    launch = CpuExecutor._launch
    spans = regions(mk, dg)

    def note(ptrs, mask, write):
        node = current["node"]
        if node is None:
            return
        # as a boolean: a mask the interpreter holds as integers would otherwise index, not select
        addrs = ptrs.data[np.broadcast_to(mask.data, ptrs.data.shape).astype(bool)].astype(np.int64).ravel()
        for base, end, size, width, rows in spans:
            element = (addrs[(addrs >= base) & (addrs < end)] - base) // size
            for row, column in set(zip((element // width if rows else 0 * element - 1).tolist(),
                                       (element % width).tolist(), strict=True)):
                log[node].add((base, write, column, row))

    def recording_load(self, ptrs, mask, other, *rest):
        note(ptrs, mask, False)
        return load(self, ptrs, mask, other, *rest)

    def recording_store(self, ptrs, value, mask, *rest):
        note(ptrs, mask, True)
        return store(self, ptrs, value, mask, *rest)

    def recording_launch(self, kernel, worker, *args):
        if kernel is self.module.cpu_graph_inst and args[1] >= 0:
            insts, _, _ = self.graphs[self.ctl(L.C_RUN_GID)]
            current["node"] = int(insts[args[1] * DESC_WORDS + 1])
        try:
            return launch(self, kernel, worker, *args)
        finally:
            current["node"] = None

    interpreter.InterpreterBuilder.create_masked_load = recording_load
    interpreter.InterpreterBuilder.create_masked_store = recording_store
    CpuExecutor._launch = recording_launch
    try:
        yield log
    finally:
        interpreter.InterpreterBuilder.create_masked_load = load
        interpreter.InterpreterBuilder.create_masked_store = store
        CpuExecutor._launch = launch

