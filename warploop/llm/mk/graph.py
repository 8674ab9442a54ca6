"""The decode step as one static graph: nodes, their tile-level dependencies, and their buffers.

Per layer (G = KV heads, S = context splits, one GEMV node per worker at most):

    qkv tiles (input norm fused)  -> rope_kv[b, g] needs the tiles holding group g's q, k and v rows
    rope_kv[b, g] -> attn[b, g, s] for every split s -> combine[b, g]   (one split: rope_attn[b, g], all three)
    (attention nodes are per batch row b and KV head group g: B x G of them, attention.node_row)
    every combine -> o-proj tiles (residual add fused) -> gate_up tiles (post norm fused, SiLU * up)
    every gate_up -> down tiles (residual add fused) -> the next layer's qkv tiles

then lm_head tiles (final norm fused) -> a sample tile per lm_head tile (its span) -> one sample
combine (warploop/llm/mk/sample.py): the token id per row -> the loop's advance node (loop.py: the
next step's inputs, when the graph runs as a decode loop). The embedding starts the residual stream. Each
run reads its per-step values (ids, positions, context lengths, KV slots, block tables) from the
step-input block `inp` (layout.StepInputs), a buffer of the graph like the others (not a graph
parameter), so the graph is built once per batch bucket and replayed every step. Buffers are
fixed per graph; write-after-read hazards on them (the residual stream, qkv, attention output)
are ordered by these edges: every reader of a layer's buffer is an ancestor of the next writer
of it.
"""
from __future__ import annotations

import bisect
import collections
import dataclasses

from warploop.llm.config import ModelConfig
from warploop.llm.kv_cache import cdiv
from warploop.llm.mk.kinds import KINDS
from warploop.llm.mk.layout import Plan, StepInputs
from warploop.llm.mk.loop import MAX_STEPS, LoopBlock, Mailbox
from warploop.llm.mk.tasks import MkTasks

# GEMV tiles per node in the graphs of more than one row (tiles plans): their rows are multiplied
# through tl.dot blocks, so a longer node pays its wait, signal and epilogue over more weights.
# Measured on an H100 (BENCHMARKS.md, Decode, sessions 8 and 10): 2 ran bs8 1.39x and bs32 1.34x
# faster than 1; 4 was 1-3% slower than 2, 8 and 16 much slower (a node's blocks are one chain of loads).
BATCH_TILES = 2


@dataclasses.dataclass
class StepBuffers:
    """A graph's own memory: the step inputs and every activation, for `batch` rows."""

    inp: object          # int32 [StepInputs.words(batch, width, width * block_size)]
    res: object          # [batch, hidden]: the residual stream
    qkv: object          # [batch, q + 2 kv]
    attn: object         # [batch, q]
    act: object          # [batch, intermediate]: silu(gate) * up
    parts: object        # float32 [batch, heads, splits, head_dim]
    lse: object          # float32 [batch, heads, splits]
    logits: object       # float32 [batch, vocab]
    tokens: object       # int32 [batch]: the graph's pick (sampled or greedy; -1: sample on the host)
    fstat: object        # float32 [batch, sample tiles, 3]: each tile's max, sum of exp, race value
    istat: object        # int32 [batch, sample tiles, 2 + KC]: its argmax, race winner, candidates
    loop: object         # int32 [LoopBlock(batch, free).words]: the decode loop's state (loop.py)
    mail: object         # int32 [Mailbox(batch, MAX_STEPS).words], pinned host memory on a GPU

    @classmethod
    def allocate(cls, cfg: ModelConfig, plan: Plan, batch: int, width: int, dtype, device,
                 gemv_nodes: int) -> StepBuffers:
        import torch

        def z(*shape, dt=dtype):
            return torch.zeros(shape, dtype=dt, device=device)

        tiles = len(sample_spans(plan, cfg.vocab_size, gemv_nodes))
        mail = torch.zeros(Mailbox(batch, MAX_STEPS).words, dtype=torch.int32,
                           pin_memory=torch.device(device).type == "cuda")
        return cls(inp=z(StepInputs.words(batch, width, width * plan.block_size), dt=torch.int32),
                   res=z(batch, cfg.hidden_size),
                   qkv=z(batch, cfg.q_size + 2 * cfg.kv_size), attn=z(batch, cfg.q_size),
                   act=z(batch, cfg.intermediate_size),
                   parts=z(batch, cfg.num_heads, plan.splits, cfg.head_dim, dt=torch.float32),
                   lse=z(batch, cfg.num_heads, plan.splits, dt=torch.float32),
                   logits=z(batch, cfg.vocab_size, dt=torch.float32), tokens=z(batch, dt=torch.int32),
                   fstat=z(batch, tiles, 3, dt=torch.float32),
                   istat=z(batch, tiles, 2 + plan.candidates, dt=torch.int32),
                   loop=z(loop_block(batch, plan.block_size).words, dt=torch.int32), mail=mail)


def loop_block(batch: int, block_size: int) -> LoopBlock:
    """A graph's loop block: room for every row to start a fresh block each block_size steps."""
    return LoopBlock(batch, batch * (cdiv(MAX_STEPS, block_size) + 1))


def spans(rows: int, bn: int, nodes: int) -> list[tuple[int, int]]:
    """(first row, row count) of at most `nodes` spans of whole BN-row blocks covering `rows`."""
    blocks = cdiv(rows, bn)
    per = cdiv(blocks, max(1, min(nodes, blocks)))
    return [(b * bn, per * bn) for b in range(0, blocks, per)]


def gemv_spans(plan: Plan, rows: int, tn: int, nodes: int, per: int = 1) -> list[tuple[int, int]]:
    """The nodes of a GEMV over `rows` output rows: `per` tiles of TN rows each when the plan has
    tiles (tn, from Plan.tile_constexprs), else at most `nodes` spans of whole BN-row blocks."""
    if tn:
        return [(r, tn * per) for r in range(0, rows, tn * per)]
    return spans(rows, plan.bn, nodes)


def sample_spans(plan: Plan, vocab: int, nodes: int) -> list[tuple[int, int]]:
    """The sample tiles' spans of the vocabulary: at most `nodes`, each of whole lm_head nodes."""
    return spans(vocab, max(plan.bn, plan.tile_constexprs()["TND"]), nodes)


def _overlaps(span: tuple[int, int], ranges) -> bool:
    return any(span[0] < hi and lo < span[0] + span[1] for lo, hi in ranges)


@dataclasses.dataclass
class DecodeGraph:
    graph: object
    buffers: StepBuffers
    batch: int
    width: int
    history_width: int             # previous-token entries per row in the step inputs (max context)
    kinds: collections.Counter     # nodes per task kind
    labels: list[str]              # each node's task kind, by node index (hazards.py reads them)


def build_decode_graph(rt, tasks: MkTasks, plan: Plan, cfg: ModelConfig, weights, kv, cos, sin,
                       buffers: StepBuffers, batch: int, width: int, gemv_nodes: int,
                       fused: bool | None = None) -> DecodeGraph:
    """Record the step graph for `batch` rows on runtime `rt` (compiled on its first run).

    weights: ModelWeights; kv: the cache [layers, 2, blocks, block_size, kv_heads, head_dim];
    cos, sin: float32 RoPE tables [positions, head_dim // 2]; gemv_nodes: most nodes per GEMV;
    fused: attention as one rope_attn node per (row, group) (short contexts: one stage a layer)
    instead of rope_kv, plan.splits attn splits and a combine (default: when plan.splits is 1).
    In a graph of more than one row a GEMV node owns BATCH_TILES tiles (their rows go through tl.dot
    blocks, not held in registers: fewer, longer nodes).
    """
    if plan.one_row and batch > 1:
        raise ValueError(f"a batch-1 kernel's plan (Plan.one_row) runs the graph of one row, not {batch}: record "
                         "batch graphs on a runtime of a plan without one_row")
    per = BATCH_TILES if batch > 1 else 1
    fused = plan.splits == 1 if fused is None else fused
    g = rt.graph()
    # the step inputs at a fixed address, as every other buffer: a graph parameter would cost each
    # node one more dependent load at dispatch (worker.arg), which ptxas spills at once and waits for
    inp = buffers.inp
    kinds: collections.Counter = collections.Counter()
    labels: list[str] = []
    d, q, kvs, f, hd = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size, cfg.head_dim
    group, eps, b = cfg.num_heads // cfg.num_kv_heads, cfg.rms_norm_eps, buffers
    tn = plan.tile_constexprs()

    def add(kind, after=(), **fields):
        """A node of `kind` (kinds.KINDS) from its fields by name: its declaration orders them into
        the task's arguments and prices it."""
        declared = KINDS[kind]
        kinds[kind] += 1
        labels.append(kind)
        return g.add(getattr(tasks, kind), *declared.args(fields), after=after,
                     cost=float(declared.cost(fields, plan, batch)))

    def opt(t):
        return (t, 1) if t is not None else (0, 0)

    def gemv(kind, rows_per_tile, after, **fields):
        """The nodes of one GEMV, as (span of output rows, node): its output rows (the kind's `rows`
        field) cut into spans, each a node's row0 and count."""
        after = tuple(after)        # one tuple for every tile: Graph.add works out its deps once
        return [(sp, add(kind, after=after, row0=sp[0], count=sp[1], **fields))
                for sp in gemv_spans(plan, fields[KINDS[kind].rows], rows_per_tile, gemv_nodes, per)]

    prev = [add("embed", inp=inp, table=weights.embed, res=b.res, d=d)]
    for i, lw in enumerate(weights.layers):
        kc, vc = kv[i, 0], kv[i, 1]
        bias, has = opt(lw.qkv_bias)
        qkv_nodes = gemv("qkv", tn["TND"], prev, inp=inp, w=lw.qkv, bias=bias, res=b.res, norm_w=lw.input_norm,
                         out=b.qkv, k=d, n_out=q + 2 * kvs, eps=eps, has_bias=has)
        qn, kn = (lw.q_norm, lw.k_norm) if lw.q_norm is not None else (0, 0)
        rope = dict(inp=inp, qkv=b.qkv, cos=cos, sin=sin, qn=qn, kn=kn, kc=kc, vc=vc)
        combines = []
        for n in range(batch * cfg.num_kv_heads):      # one node per KV head group and batch row
            kvh = n % cfg.num_kv_heads
            rows = [(kvh * group * hd, (kvh + 1) * group * hd), (q + kvh * hd, q + (kvh + 1) * hd),
                    (q + kvs + kvh * hd, q + kvs + (kvh + 1) * hd)]
            qkv_of_group = [m for s, m in qkv_nodes if _overlaps(s, rows)]
            if fused:               # rope, attention and combine of the group in one node
                combines.append(add("rope_attn", after=qkv_of_group, **rope, out=b.attn, n=n,
                                    qk_eps=eps if cfg.qk_norm else -1.0, scale=hd ** -0.5))
                continue
            roped = add("rope_kv", after=qkv_of_group, **rope, n=n, eps=eps, has_qk_norm=int(cfg.qk_norm))
            splits = [add("attn", after=[roped], inp=inp, qkv=b.qkv, kc=kc, vc=vc, parts=b.parts, lse=b.lse, n=n,
                          split=s, scale=hd ** -0.5) for s in range(plan.splits)]
            combines.append(add("combine", after=splits, inp=inp, parts=b.parts, lse=b.lse, out=b.attn, n=n))
        bias, has = opt(lw.o_bias)
        o = [n for _, n in gemv("o_proj", tn["TNQ"], combines, inp=inp, w=lw.o, bias=bias, x=b.attn, res=b.res,
                                k=q, n_out=d, has_bias=has)]
        bias, has = opt(lw.gate_up_bias)
        gate_up = [n for _, n in gemv("gate_up", tn["TNS"], o, inp=inp, w=lw.gate_up, bias=bias, res=b.res,
                                      norm_w=lw.post_norm, out=b.act, k=d, f=f, eps=eps, has_bias=has)]
        bias, has = opt(lw.down_bias)
        prev = [n for _, n in gemv("down", tn["TNF"], gate_up, inp=inp, w=lw.down, bias=bias, x=b.act, res=b.res,
                                   k=f, n_out=d, has_bias=has)]
    heads = gemv("lm_head", tn["TND"], prev, inp=inp, w=weights.lm_head, res=b.res, norm_w=weights.norm,
                 logits=b.logits, k=d, vocab=cfg.vocab_size, eps=eps)
    vocab_spans = sample_spans(plan, cfg.vocab_size, gemv_nodes)
    # the lm_head nodes each sample tile reads: heads are in row order, so those overlapping a span are
    # a run of them, found by bisection (thousands of each on a GPU plan)
    starts, ends = [h[0] for h, _ in heads], [h[0] + h[1] for h, _ in heads]
    tiles = [add("sample_tile", after=[n for _, n in heads[bisect.bisect_right(ends, s[0]):
                                                           bisect.bisect_left(starts, s[0] + s[1])]], inp=inp,
                 logits=b.logits, fstat=b.fstat, istat=b.istat, vocab=cfg.vocab_size, row0=s[0], count=s[1], tile=t,
                 ntiles=len(vocab_spans))
             for t, s in enumerate(vocab_spans)]
    chosen = add("sample_combine", after=tiles, inp=inp, logits=b.logits, fstat=b.fstat, istat=b.istat,
                 tokens=b.tokens, vocab=cfg.vocab_size, ntiles=len(vocab_spans))
    # the decode loop (loop.py): a no-op unless a loop request set the loop block on
    mail = b.mail.data_ptr() if hasattr(b.mail, "data_ptr") else b.mail     # pinned host memory: by address
    add("advance", after=[chosen], inp=inp, tokens=b.tokens, loop=b.loop, mail=mail, halt=g.halt_address())
    return DecodeGraph(g, buffers, batch, width, width * plan.block_size, kinds, labels)


def describe(dg: DecodeGraph) -> dict:
    """The compiled graph's shape: nodes per kind, counters, instructions per worker."""
    if dg.graph.schedule is None:
        dg.graph.descriptors()          # placement and counters only: nothing is uploaded
    schedule = dg.graph.schedule
    per_worker = sorted(len(lst) for lst in schedule.lists)
    nops = sum(1 for lst in schedule.lists for inst in lst if inst.node < 0)
    return {"batch": dg.batch, "nodes": len(dg.graph), "by_kind": dict(dg.kinds),
            "counters": len(schedule.counter_sizes), "nop_join_points": nops,
            "instructions": schedule.instruction_count,
            "per_worker": {"min": per_worker[0], "median": per_worker[len(per_worker) // 2], "max": per_worker[-1]},
            "waits": sum(len(inst.waits) for lst in schedule.lists for inst in lst)}
