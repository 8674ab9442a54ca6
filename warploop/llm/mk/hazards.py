"""Memory hazards of a decode graph: what each node reads and writes, and whether every
conflicting pair of nodes is ordered.

The CPU executor runs a graph's nodes one at a time in one fixed legal order, so a missing
dependency edge never shows there; on a GPU the two nodes run at once on different workers and
race. `hazards(dg)` finds such pairs without running anything.

Footprints are declared per task kind from the node's arguments (the same positions as in
graph.py's `add` calls), in columns of the buffer seen as [rows, columns]:

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
attention node (rope_kv, attn, combine, rope_attn; node index n) only row b = n // KVH of each
step buffer, and of the KV cache only row b's sequence: the slot it writes is its own (the block
manager never shares a sequence's partial block), and the shared prefix blocks it reads are
never written. So an access is columns of every row, or of one row. Weights, norms and the RoPE
tables are never written by a graph and are left out; so are the step inputs and the mailbox,
which only the advance node writes, and it is the graph's sink: every other node is its ancestor,
and the next run starts after it. tests/test_mk_hazards.py
checks these declarations against the loads and stores the interpreter really makes.
"""
from __future__ import annotations

import bisect
import dataclasses

from warploop.llm.mk.layout import Plan

WHOLE = 2 ** 31 - 1      # the columns of a buffer read or written as a whole (one row)


@dataclasses.dataclass(frozen=True)
class Access:
    buffer: int          # the buffer's address
    lo: int              # columns [lo, hi) of each row
    hi: int
    write: bool
    row: int = -1        # one batch row's (attention nodes), or -1: every row's


def address(value) -> int:
    return value.data_ptr() if hasattr(value, "data_ptr") else int(value)


def footprint(plan: Plan, kind: str, args: tuple) -> list[Access]:
    """The accesses of one node of `kind` with these graph arguments (see the table above)."""
    G, H, KVH, HD, S = plan.group, plan.heads, plan.kv_heads, plan.head_dim, plan.splits

    row = -1

    def acc(buf, lo, hi, write=False):
        return Access(address(buf), int(lo), int(hi), write, row)

    if kind == "embed":
        _, _, res, d = args
        return [acc(res, 0, d, True)]
    if kind in ("qkv", "gate_up"):
        _, _, _, res, _, out, k, n, row0, count, _, _ = args
        return [acc(res, 0, k), acc(out, row0, min(row0 + count, n), True)]
    if kind == "lm_head":
        _, _, res, _, logits, k, vocab, row0, count, _ = args
        return [acc(res, 0, k), acc(logits, row0, min(row0 + count, vocab), True)]
    if kind in ("o_proj", "down"):
        _, _, _, x, res, k, n, row0, count, _ = args
        end = min(row0 + count, n)
        return [acc(x, 0, k), acc(res, row0, end), acc(res, row0, end, True)]
    if kind in ("rope_kv", "attn", "combine", "rope_attn"):
        n = args[{"rope_kv": 8, "attn": 6, "combine": 4, "rope_attn": 9}[kind]]
        g, row = n % KVH, n // KVH
    if kind == "rope_kv":
        _, qkv, _, _, _, _, kc, vc, _, _, _ = args
        q = (g * G * HD, (g + 1) * G * HD)
        k = ((H + g) * HD, (H + g + 1) * HD)
        v = ((H + KVH + g) * HD, (H + KVH + g + 1) * HD)
        return [acc(qkv, *q), acc(qkv, *k), acc(qkv, *v), acc(qkv, *q, True), acc(qkv, *k, True),
                acc(kc, g * HD, (g + 1) * HD, True), acc(vc, g * HD, (g + 1) * HD, True)]
    if kind == "rope_attn":     # rope_kv's reads and cache writes (its q and k stay in registers)
        _, qkv, _, _, _, _, kc, vc, out, _, _, _ = args
        rope = [a for a in footprint(plan, "rope_kv", (None, qkv, None, None, None, None, kc, vc, n, None, None))
                if not (a.write and a.buffer == address(qkv))]
        return rope + [acc(kc, g * HD, (g + 1) * HD), acc(vc, g * HD, (g + 1) * HD),
                       acc(out, g * G * HD, (g + 1) * G * HD, True)]
    if kind == "attn":
        _, qkv, kc, vc, parts, lse, _, split, _ = args
        heads = range(g * G, (g + 1) * G)
        return ([acc(qkv, g * G * HD, (g + 1) * G * HD), acc(kc, g * HD, (g + 1) * HD),
                 acc(vc, g * HD, (g + 1) * HD)]
                + [acc(parts, (h * S + split) * HD, (h * S + split + 1) * HD, True) for h in heads]
                + [acc(lse, h * S + split, h * S + split + 1, True) for h in heads])
    if kind == "combine":
        _, parts, lse, out, _ = args
        return [acc(parts, g * G * S * HD, (g + 1) * G * S * HD), acc(lse, g * G * S, (g + 1) * G * S),
                acc(out, g * G * HD, (g + 1) * G * HD, True)]
    if kind == "sample_tile":
        _, logits, fstat, istat, vocab, row0, count, tile, _ = args
        end, per = min(row0 + count, vocab), 2 + plan.candidates
        return [acc(logits, row0, end), acc(logits, row0, end, True), acc(fstat, 3 * tile, 3 * tile + 3, True),
                acc(istat, per * tile, per * tile + per, True)]
    if kind == "sample_combine":
        _, logits, fstat, istat, tokens, vocab, ntiles = args
        return [acc(logits, 0, vocab), acc(fstat, 0, 3 * ntiles), acc(istat, 0, (2 + plan.candidates) * ntiles),
                acc(tokens, 0, 1, True)]
    if kind == "advance":
        _, tokens, loop, _, _ = args
        return [acc(tokens, 0, 1), acc(loop, 0, WHOLE), acc(loop, 0, WHOLE, True)]
    raise ValueError(f"no footprint declared for node kind {kind!r}: add it to hazards.footprint")


@dataclasses.dataclass(frozen=True)
class Hazard:
    kind: str            # RAW, WAR or WAW
    first: int           # node indices, first < second in recording (program) order
    second: int
    buffer: int
    columns: tuple[int, int]

    def describe(self, labels: list[str]) -> str:
        return (f"{self.kind} on buffer {self.buffer:#x} columns {self.columns[0]}:{self.columns[1]}: node "
                f"{self.first} ({labels[self.first]}) and node {self.second} ({labels[self.second]}) are not ordered")


def ancestors(deps: list[tuple[int, ...]]) -> list[int]:
    """Bit sets: bit a of result[b] is set when node a reaches node b through dependency edges."""
    out: list[int] = []
    for ds in deps:
        bits = 0
        for d in ds:
            bits |= out[d] | (1 << d)
        out.append(bits)
    return out


class _Interval:
    """What is known of one elementary column interval of a buffer: its last writer of every row
    and the readers of every row since, then per row the last writer and readers since (a write of
    every row clears the rows)."""

    __slots__ = ("writer", "readers", "row_writer", "row_readers")

    def __init__(self):
        self.writer: int | None = None
        self.readers: list[int] = []
        self.row_writer: dict[int, int] = {}
        self.row_readers: dict[int, list[int]] = {}

    def writers_met(self, row: int):
        """The last writers an access of `row` (-1: every row) must come after."""
        if row >= 0:
            w = self.row_writer.get(row, self.writer)
            return () if w is None else (w,)
        if not self.row_writer:
            return () if self.writer is None else (self.writer,)
        return ([] if self.writer is None else [self.writer]) + list(self.row_writer.values())

    def readers_met(self, row: int):
        """The readers since those writers that a write of `row` must come after."""
        if not self.row_readers:
            return self.readers
        if row >= 0:
            return self.readers + self.row_readers.get(row, [])
        return self.readers + [r for rs in self.row_readers.values() for r in rs]

    def record(self, node: int, row: int, write: bool) -> None:
        if write and row < 0:
            self.writer, self.readers, self.row_writer, self.row_readers = node, [], {}, {}
        elif write:
            self.row_writer[row], self.row_readers[row] = node, []
        elif row < 0:
            self.readers.append(node)
        else:
            self.row_readers.setdefault(row, []).append(node)


def check(deps: list[tuple[int, ...]], worker_of: list[int], accesses: list[list[Access]]) -> list[Hazard]:
    """Every pair of nodes that touch the same columns of a buffer in a common row, one of them
    writing, must be ordered: by dependency edges (transitively) when on different workers; on
    one worker, by its list (recording) order, which holds by construction. Returns the pairs
    that are not.

    Per buffer the columns are cut into elementary intervals, each keeping its last writers and
    the readers since (_Interval): checking a new access against those suffices, as every earlier
    access was checked against them in turn and the order is transitive. (Checking a pair more
    than needed reports nothing false: any two conflicting accesses must be ordered.)
    """
    anc = ancestors(deps)
    cuts: dict[int, list[int]] = {}
    for accs in accesses:
        for a in accs:
            cuts.setdefault(a.buffer, set()).update((a.lo, a.hi))
    cuts = {b: sorted(c) for b, c in cuts.items()}
    state = {b: [_Interval() for _ in range(len(c) - 1)] for b, c in cuts.items()}
    found: dict[tuple[int, int, str], Hazard] = {}

    for node, accs in enumerate(accesses):
        # whether node comes after each earlier node it meets: a node meets the same others over
        # many intervals, and a test of its ancestors' bit shifts an integer of one bit a node
        after = {node: True}
        mine, above = worker_of[node], anc[node]
        updates = []
        for a in accs:
            cut, ivs, row = cuts[a.buffer], state[a.buffer], a.row
            lo, hi = bisect.bisect_left(cut, a.lo), bisect.bisect_left(cut, a.hi)
            first = "WAW" if a.write else "RAW"
            for k in range(lo, hi):
                iv = ivs[k]
                met = ((iv.writers_met(row), first), (iv.readers_met(row), "WAR")) if a.write else \
                    ((iv.writers_met(row), first),)
                for others, kind in met:
                    for o in others:
                        ok = after.get(o)
                        if ok is None:
                            ok = after[o] = worker_of[o] == mine or bool((above >> o) & 1)
                        if not ok:
                            found.setdefault((o, node, kind), Hazard(kind, o, node, a.buffer, (cut[k], cut[k + 1])))
                updates.append((iv, row, a.write))
        for iv, row, write in updates:
            if write:
                iv.record(node, row, True)
        for iv, row, write in updates:
            if not write:
                iv.record(node, row, False)
    return sorted(found.values(), key=lambda h: (h.second, h.first))


def graph_accesses(dg, plan: Plan) -> list[list[Access]]:
    return [footprint(plan, kind, node.args) for kind, node in zip(dg.labels, dg.graph.nodes, strict=True)]


def hazards(dg, plan: Plan) -> list[Hazard]:
    """The unordered conflicting node pairs of decode graph `dg` (graph.DecodeGraph) as placed."""
    if dg.graph.schedule is None:
        dg.graph.descriptors()          # placement and counters only: nothing is uploaded
    deps = [tuple(n.deps) for n in dg.graph.nodes]
    return check(deps, list(dg.graph.schedule.worker_of), graph_accesses(dg, plan))


def unrealised_edges(deps: list[tuple[int, ...]], schedule) -> list[tuple[int, int]]:
    """Dependency edges (d, i) the compiled schedule does not enforce: d neither precedes i on
    i's worker nor signals a counter that i (or a join point just before it) waits on to the
    count of that counter's signallers."""
    position, waits_of, signal = {}, {}, {}
    for lst in schedule.lists:
        pending: list = []
        for k, inst in enumerate(lst):
            pending += inst.waits
            if inst.node >= 0:
                position[inst.node], waits_of[inst.node], signal[inst.node] = k, set(pending), inst.signal
                pending = []
    signallers: dict[int, int] = {}
    for s in signal.values():
        if s >= 0:
            signallers[s] = signallers.get(s, 0) + 1
    worker_of = schedule.worker_of
    missing = []
    for i, ds in enumerate(deps):
        for d in ds:
            local = worker_of[d] == worker_of[i] and position[d] < position[i]
            counted = signal[d] >= 0 and (signal[d], signallers[signal[d]]) in waits_of[i]
            if not (local or counted):
                missing.append((d, i))
    return missing
