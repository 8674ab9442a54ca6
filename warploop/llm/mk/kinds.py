"""The decode graph's node kinds, declared once, as data.

A kind names its run-time fields and their types (the task function's parameters in order, less
`ctx`, its constexprs and `BACKEND`), its constexprs (bound per Plan), whether its body waits
itself, its cost (for placement) and its footprint (for the hazard check), both functions of its
fields by name. tasks.py registers each task from its kind, graph.py builds each node from named
fields (`kind.args(fields)` orders them), and hazards.py reads a node's fields by name
(`kind.named(node.args)`); tests/test_mk_hazards.py checks the names against the functions.

Footprints are in columns of each buffer seen as [rows, columns]:

| kind | reads | writes |
|---|---|---|
| embed | - | res[:, 0:d] |
| qkv, gate_up, lm_head | res[:, 0:k] | out[:, row0:end] |
| o_proj, down | x[:, 0:k], res[:, row0:end] | res[:, row0:end] |
| rope_kv[b, g] | qkv: g's q heads, k head, v head | qkv: g's q heads and k head; k and v cache: head g |
| attn[b, g, s] | qkv: g's q heads; k and v cache: head g | parts and lse: g's heads, split s |
| combine[b, g] | parts and lse: g's heads, every split | attn: g's heads |
| rope_attn[b, g] (fused) | as rope_kv[b, g], and k and v cache: head g | k and v cache: head g; attn: g's heads |
| sample_tile[t] | logits[:, row0:end] | logits[:, row0:end] (penalty), fstat and istat: tile t |
| sample_combine | logits[:, 0:vocab], fstat and istat: every tile | tokens |
| advance | tokens, the loop block | the loop block (and the step inputs, the mailbox: loop.py) |

Rows: a GEMV, sample or embedding node covers every live batch row (it owns columns), an
attention node (rope_kv, attn, combine, rope_attn; field n) only row b = n // KVH of each step
buffer, and of the KV cache only row b's sequence: the slot it writes is its own (the block
manager never shares a sequence's partial block), and the shared prefix blocks it reads are
never written. So an access is columns of every row, or of one row. Weights, norms and the RoPE
tables are never written by a graph and are left out; so are the step inputs and the mailbox,
which only the advance node writes, and it is the graph's sink: every other node is its ancestor,
and the next run starts after it.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

from warploop.llm.mk.layout import Plan

ATTN_COST_TOKENS = 1024      # the context placement assumes for an attention split's cost
WHOLE = 2 ** 31 - 1          # the columns of a buffer read or written as a whole (one row)
# field types; "{dt}" is the plan's dtype. Weights, the graph's buffers and the norms (aligned by the
# backend: backend.aligned_norms) are 16-byte aligned; biases, q/k norms and KV-cache layers are not promised
ALIGNED, PLAIN, F32, I32P, I32, FP32 = "*{dt}:16", "*{dt}", "*fp32", "*i32", "i32", "fp32"


@dataclasses.dataclass(frozen=True)
class Access:
    buffer: int          # the buffer's address
    lo: int              # columns [lo, hi) of each row
    hi: int
    write: bool
    row: int = -1        # one batch row's (attention nodes), or -1: every row's


def address(value) -> int:
    return value.data_ptr() if hasattr(value, "data_ptr") else int(value)


@dataclasses.dataclass(frozen=True)
class NodeKind:
    name: str
    fields: tuple[tuple[str, str], ...]          # (name, type) in the task's argument order
    constexprs: tuple[str, ...]                  # Plan.constexprs() names, in parameter order
    cost: Callable[[dict, Plan, int], float]     # (fields, plan, batch) -> relative run time
    footprint: Callable[[dict, Plan], list[Access]]
    waits: bool = False                          # the body calls wl.wait after its first loads
    rows: str | None = None                      # a GEMV's field of output rows, cut into nodes by graph.py

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.fields)

    def signature(self, dtype: str) -> dict[str, str]:
        return {name: type.format(dt=dtype) for name, type in self.fields}

    def args(self, fields: dict) -> tuple:
        """The task's positional arguments from fields by name; refuses unknown or missing names."""
        unknown, missing = set(fields) - set(self.names), set(self.names) - set(fields)
        if unknown or missing:
            raise TypeError(f"node kind {self.name}: unknown fields {sorted(unknown)}, missing {sorted(missing)} "
                            f"(its fields: {', '.join(self.names)})")
        return tuple(fields[name] for name in self.names)

    def named(self, args: tuple) -> dict:
        """A node's arguments by field name."""
        return dict(zip(self.names, args, strict=True))


def _acc(buf, lo, hi, write=False, row=-1) -> Access:
    return Access(address(buf), int(lo), int(hi), write, row)


def _gemv_footprint(x: str, n: str, out: str, adds: bool):
    """Reads x[:, 0:k]; writes out[:, row0:end] (rows of n), adding to what it holds when `adds`."""
    def footprint(f: dict, plan: Plan) -> list[Access]:
        end = min(f["row0"] + f["count"], f[n])
        added = [_acc(f[out], f["row0"], end)] if adds else []
        return [_acc(f[x], 0, f["k"]), *added, _acc(f[out], f["row0"], end, True)]
    return footprint


def _group_row(f: dict, plan: Plan) -> tuple[int, int]:
    """An attention node's KV head group and batch row (attention.node_row)."""
    return f["n"] % plan.kv_heads, f["n"] // plan.kv_heads


def _rope_kv(f: dict, plan: Plan) -> list[Access]:
    (g, row), G, H, KVH, HD = _group_row(f, plan), plan.group, plan.heads, plan.kv_heads, plan.head_dim
    q = (g * G * HD, (g + 1) * G * HD)
    k = ((H + g) * HD, (H + g + 1) * HD)
    v = ((H + KVH + g) * HD, (H + KVH + g + 1) * HD)
    qkv = f["qkv"]
    return [_acc(qkv, *q, row=row), _acc(qkv, *k, row=row), _acc(qkv, *v, row=row), _acc(qkv, *q, True, row),
            _acc(qkv, *k, True, row), _acc(f["kc"], g * HD, (g + 1) * HD, True, row),
            _acc(f["vc"], g * HD, (g + 1) * HD, True, row)]


def _rope_attn(f: dict, plan: Plan) -> list[Access]:
    """rope_kv's reads and cache writes (its q and k stay in registers), the cache, its output."""
    (g, row), G, HD = _group_row(f, plan), plan.group, plan.head_dim
    rope = [a for a in _rope_kv(f, plan) if not (a.write and a.buffer == address(f["qkv"]))]
    return rope + [_acc(f["kc"], g * HD, (g + 1) * HD, row=row), _acc(f["vc"], g * HD, (g + 1) * HD, row=row),
                   _acc(f["out"], g * G * HD, (g + 1) * G * HD, True, row)]


def _attn(f: dict, plan: Plan) -> list[Access]:
    (g, row), G, HD, S, split = _group_row(f, plan), plan.group, plan.head_dim, plan.splits, f["split"]
    heads = range(g * G, (g + 1) * G)
    return ([_acc(f["qkv"], g * G * HD, (g + 1) * G * HD, row=row), _acc(f["kc"], g * HD, (g + 1) * HD, row=row),
             _acc(f["vc"], g * HD, (g + 1) * HD, row=row)]
            + [_acc(f["parts"], (h * S + split) * HD, (h * S + split + 1) * HD, True, row) for h in heads]
            + [_acc(f["lse"], h * S + split, h * S + split + 1, True, row) for h in heads])


def _combine(f: dict, plan: Plan) -> list[Access]:
    (g, row), G, HD, S = _group_row(f, plan), plan.group, plan.head_dim, plan.splits
    return [_acc(f["parts"], g * G * S * HD, (g + 1) * G * S * HD, row=row),
            _acc(f["lse"], g * G * S, (g + 1) * G * S, row=row),
            _acc(f["out"], g * G * HD, (g + 1) * G * HD, True, row)]


def _sample_tile(f: dict, plan: Plan) -> list[Access]:
    end, per, tile, logits = min(f["row0"] + f["count"], f["vocab"]), 2 + plan.candidates, f["tile"], f["logits"]
    return [_acc(logits, f["row0"], end), _acc(logits, f["row0"], end, True),
            _acc(f["fstat"], 3 * tile, 3 * tile + 3, True), _acc(f["istat"], per * tile, per * tile + per, True)]


def _sample_combine(f: dict, plan: Plan) -> list[Access]:
    return [_acc(f["logits"], 0, f["vocab"]), _acc(f["fstat"], 0, 3 * f["ntiles"]),
            _acc(f["istat"], 0, (2 + plan.candidates) * f["ntiles"]), _acc(f["tokens"], 0, 1, True)]


def _gemv_constexprs(k: str, tile: str) -> tuple[str, ...]:
    """A GEMV's constexprs: K its compile-time width, TN/TK its tile (Plan.tile_constexprs)."""
    return ("R", "BN", "BK", k, "DEPTH", f"TN{tile}", f"TK{tile}", "ONE")


def _gemv_cost(f: dict, plan: Plan, batch: int) -> float:
    return f["count"] * f["k"]          # weight elements


def _fields(**types: str) -> tuple[tuple[str, str], ...]:
    return tuple(types.items())


_NORMED = _fields(inp=I32P, w=ALIGNED, bias=PLAIN, res=ALIGNED, norm_w=ALIGNED, out=ALIGNED, k=I32)
_PROJ = _fields(inp=I32P, w=ALIGNED, bias=PLAIN, x=ALIGNED, res=ALIGNED, k=I32, n_out=I32, row0=I32, count=I32,
                has_bias=I32)
_SPAN = _fields(row0=I32, count=I32, eps=FP32, has_bias=I32)
_ROPE = _fields(inp=I32P, qkv=ALIGNED, cos=F32, sin=F32, qn=PLAIN, kn=PLAIN, kc=PLAIN, vc=PLAIN)

KINDS: dict[str, NodeKind] = {k.name: k for k in (
    NodeKind("embed", _fields(inp=I32P, table=ALIGNED, res=ALIGNED, d=I32), ("BK",),
             cost=lambda f, plan, batch: batch * f["d"],
             footprint=lambda f, plan: [_acc(f["res"], 0, f["d"], True)]),
    NodeKind("qkv", _NORMED + _fields(n_out=I32) + _SPAN, _gemv_constexprs("KD", "D"), cost=_gemv_cost,
             footprint=_gemv_footprint("res", "n_out", "out", False), waits=True, rows="n_out"),
    NodeKind("gate_up", _NORMED + _fields(f=I32) + _SPAN, _gemv_constexprs("KD", "S"),
             cost=lambda f, plan, batch: 2 * f["count"] * f["k"],        # gate and up rows
             footprint=_gemv_footprint("res", "f", "out", False), waits=True, rows="f"),
    NodeKind("o_proj", _PROJ, _gemv_constexprs("KQ", "Q"), cost=_gemv_cost,
             footprint=_gemv_footprint("x", "n_out", "res", True), waits=True, rows="n_out"),
    NodeKind("down", _PROJ, _gemv_constexprs("KF", "F"), cost=_gemv_cost,
             footprint=_gemv_footprint("x", "n_out", "res", True), waits=True, rows="n_out"),
    NodeKind("lm_head", _fields(inp=I32P, w=ALIGNED, res=ALIGNED, norm_w=ALIGNED, logits=F32, k=I32, vocab=I32,
                                row0=I32, count=I32, eps=FP32), _gemv_constexprs("KD", "D"), cost=_gemv_cost,
             footprint=_gemv_footprint("res", "vocab", "logits", False), waits=True, rows="vocab"),
    NodeKind("rope_kv", _ROPE + _fields(n=I32, eps=FP32, has_qk_norm=I32),
             ("H", "KVH", "HD", "HDP", "HALFP", "GP1"),
             cost=lambda f, plan, batch: (plan.group + 2) * plan.head_dim, footprint=_rope_kv),
    NodeKind("attn", _fields(inp=I32P, qkv=ALIGNED, kc=PLAIN, vc=PLAIN, parts=F32, lse=F32, n=I32, split=I32,
                             scale=FP32), ("H", "KVH", "HD", "HDP", "GP", "BS", "TILE", "S"),
             cost=lambda f, plan, batch: 2 * ATTN_COST_TOKENS * plan.head_dim // plan.splits, footprint=_attn),
    NodeKind("combine", _fields(inp=I32P, parts=F32, lse=F32, out=ALIGNED, n=I32),
             ("H", "KVH", "HD", "HDP", "S", "SP"),
             cost=lambda f, plan, batch: plan.group * plan.splits * plan.head_dim, footprint=_combine),
    NodeKind("rope_attn", _ROPE + _fields(out=ALIGNED, n=I32, qk_eps=FP32, scale=FP32),
             ("H", "KVH", "HD", "HDP", "HALFP", "GP1", "GP", "BS", "TILE"),
             cost=lambda f, plan, batch: (plan.group + 2) * plan.head_dim + 2 * ATTN_COST_TOKENS * plan.head_dim,
             footprint=_rope_attn, waits=True),
    NodeKind("sample_tile", _fields(inp=I32P, logits=F32, fstat=F32, istat=I32P, vocab=I32, row0=I32, count=I32,
                                    tile=I32, ntiles=I32), ("KC",),
             cost=lambda f, plan, batch: batch * f["count"], footprint=_sample_tile),
    NodeKind("sample_combine", _fields(inp=I32P, logits=F32, fstat=F32, istat=I32P, tokens=I32P, vocab=I32,
                                       ntiles=I32), ("KC",),
             cost=lambda f, plan, batch: batch * f["ntiles"] * plan.candidates, footprint=_sample_combine),
    NodeKind("advance", _fields(inp=I32P, tokens=I32P, loop=I32P, mail=I32P, halt=I32P), ("BS",),
             cost=lambda f, plan, batch: batch,
             footprint=lambda f, plan: [_acc(f["tokens"], 0, 1), _acc(f["loop"], 0, WHOLE),
                                        _acc(f["loop"], 0, WHOLE, True)]),
)}
