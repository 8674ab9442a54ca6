"""The streaming executor's node kinds and instruction words, declared once, as data.

An instruction is WORDS int32 words: the header (opcode, two waits, the counter it signals and by
how much: a CTA's run of tiles of one stage signals once, at its last), then
its kind's fields in declaration order. The Gluon kernel, the CPU reference, the program builder
and the hazard check all read a field by name (`GEMV.word("k")`), never by position.

A kind declares:
- its fields and their types ("i32", or "f32" carried as its bits);
- its streamed operand, what no predecessor writes: for a GEMV the fields naming a weight pool, the
  first row and the width (`Streamed`); for attention the fields locating a KV head's cached context
  in the paged cache (`StreamedKV`). The loader reads those words and fills the shared-memory ring
  with the operand's chunks, whatever the consumer is waiting on;
- its cost (bytes it streams, for placement) and its footprint (the arena ranges it reads and
  writes, for the hazard check), as functions of its fields.

    kind = GEMV
    words = Instruction(GEMV, waits=((3, 64),), signal=4, fields={...}).serialize()
    Instruction.parse(words) == ...
"""
from __future__ import annotations

import dataclasses
import functools
import struct
from collections.abc import Callable

WORDS = 32                                       # int32 words an instruction
# A wait (counter, need) of run e is met at need * (e + 1); a negative need waits on the run before,
# met at -need * e (a decode loop's embedding waits for the previous step's sampled token).
HEADER = ("op", "wait0", "need0", "wait1", "need1", "signal", "signals")
MAX_WAITS = 2
EPILOGUES = {"store": 0, "add": 1, "silu_mul": 2}   # GEMV epilogues (GEMV.fields "epi")
SAMP_WORDS = ("temperature", "seed_lo", "seed_hi", "context", "token_base")   # GEMV "samp": int-arena words
# StreamConfig.trace: int64 words an instruction, in this order: the consumer's ns stamps (start,
# waits met, first chunk in hand, handed to the publisher), then the loader's (its first chunk's slot
# free, and the ns it spent waiting for free slots: its SM's copies idle, the ring full), then the ns
# the consumer spent waiting for its chunks after the first to land (data_wait: the ring empty)
TRACE_STAMPS = ("start", "waited", "first_chunk", "published", "loader_first", "loader_blocked", "data_wait")


def header_word(name: str) -> int:
    return HEADER.index(name)


@dataclasses.dataclass(frozen=True)
class Field:
    name: str
    type: str = "i32"                            # "i32" or "f32" (stored as its bits)

    def __post_init__(self):
        if self.type not in ("i32", "f32"):
            raise ValueError(f"field {self.name!r}: type must be 'i32' or 'f32', not {self.type!r}")


@dataclasses.dataclass(frozen=True)
class Streamed:
    """Which fields name a node's streamed operand: columns [col, col + width) of weight pool `pool`,
    as ring chunks of two [BR/2, BK] boxes: the first at pool row `row`, the second at pool row
    `second` (row + BR/2 for a tile of BR contiguous rows, the up rows of a silu_mul tile, row
    itself for a narrow tile, whose second box is the next column block)."""
    pool: str
    row: str
    width: str
    second: str
    col: str


@dataclasses.dataclass(frozen=True)
class StreamedKV:
    """Which fields locate a node's cached context: KV head `kvhead` of layer `layer` in the paged
    cache ([layers, 2, blocks, bs, kv heads, hd]), the tokens of share `split` of `splits` of the
    n_ctx tokens that int-arena words at `step` give (pos, n_ctx, slot, then the block table). The
    loader streams them as ring chunks of kv_tokens tokens, each chunk the keys then the values."""
    layer: str
    kvhead: str
    step: str
    split: str
    splits: str
    blocks: str
    bs: str


@dataclasses.dataclass(frozen=True)
class NodeKind:
    name: str
    opcode: int
    fields: tuple[Field, ...]
    streamed: Streamed | StreamedKV | None = None
    cost: Callable[[dict, int], float] = lambda f, br: 1.0
    # (fields, tile rows) -> (reads, writes): lists of (arena offset, length)
    footprint: Callable[[dict, int], tuple[list, list]] = lambda f, br: ([], [])

    def __post_init__(self):
        names = [f.name for f in self.fields]
        if len(set(names)) != len(names) or set(names) & set(HEADER):
            raise ValueError(f"kind {self.name}: field names must be unique and not a header word")
        if len(HEADER) + len(self.fields) > WORDS:
            raise ValueError(f"kind {self.name}: {len(self.fields)} fields exceed the {WORDS}-word instruction")
        if self.streamed is not None:
            missing = set(dataclasses.astuple(self.streamed)) - set(names)
            if missing:
                raise ValueError(f"kind {self.name}: streamed operand names unknown fields {sorted(missing)}")

    def word(self, name: str) -> int:
        """The word index of field `name` in an instruction of this kind."""
        for i, f in enumerate(self.fields):
            if f.name == name:
                return len(HEADER) + i
        raise KeyError(f"kind {self.name} has no field {name!r} (fields: {[f.name for f in self.fields]})")

    @functools.cached_property
    def _names(self) -> frozenset:
        return frozenset(f.name for f in self.fields)

    def encode(self, values: dict) -> list[int]:
        if values.keys() != self._names:
            unknown, missing = set(values) - self._names, self._names - set(values)
            raise TypeError(f"kind {self.name}: missing fields {sorted(missing)}, unknown {sorted(unknown)}")
        out = []
        for f in self.fields:
            v = values[f.name]
            if f.type == "f32":
                out.append(struct.unpack("<i", struct.pack("<f", float(v)))[0])
            else:
                v = int(v)
                if not -2 ** 31 <= v < 2 ** 31:
                    raise ValueError(f"kind {self.name}: field {f.name}={values[f.name]} does not fit int32")
                out.append(v)
        return out

    def decode(self, words) -> dict:
        out = {}
        for i, f in enumerate(self.fields):
            w = int(words[len(HEADER) + i])
            out[f.name] = struct.unpack("<f", struct.pack("<i", w))[0] if f.type == "f32" else w
        return out


def tile_pool_rows(f: dict, br: int) -> list[tuple[int, int]]:
    """The (first pool row, count) ranges a GEMV tile streams: its two boxes' rows, or a narrow
    tile's BR/2 rows, or a tall tile's two slots of BR rows."""
    half = br // 2
    if f["tall"]:
        return [(f["row"], br), (f["row2"], br)]
    return [(f["row"], half)] if f["narrow"] else [(f["row"], half), (f["row2"], half)]


def tile_rows(f: dict, br: int) -> int:
    """The pool rows a GEMV tile streams: BR, BR/2 for a narrow tile, 2 BR for a tall one."""
    return 2 * br if f["tall"] else br // 2 if f["narrow"] else br


def _gemv_cost(f: dict, br: int) -> float:
    return float(tile_rows(f, br) * f["k"] * 2)   # bytes streamed (bf16 weights)


def _gemv_footprint(f: dict, br: int) -> tuple[list, list]:
    rows = range(f["batch"])
    reads = [(f["x"], ((f["batch"] - 1) * f["xk"] + f["k"]) // (2 if f["xbf"] else 1))]
    if f["norm"] >= 0:
        reads.append((f["norm"], f["k"]))
    outs = f["rows"]
    if f["bias"] >= 0:
        reads.append((f["bias"], outs))
    if f["epi"] == EPILOGUES["add"]:
        reads += [(f["out"] + b * f["ostride"], outs) for b in rows]
    if f["obf"]:                          # bf16 outputs: half a float each (rows and ostride even)
        writes = [(f["out"] + b * f["ostride"] // 2, outs // 2) for b in rows]
    else:
        writes = [(f["out"] + b * f["ostride"], outs) for b in rows]
    if f["amax"] >= 0:
        writes += [(f["amax"] + b * f["astride"], 2) for b in rows]
    return reads, writes


NOP = NodeKind("nop", 0, ())
# One tile of a matrix-vector product: `rows` output rows from pool rows [row, row + BR/2) and
# [row2, row2 + BR/2) times the arena vector x[0:k], optionally RMS-normalised first
# (x * rsqrt(mean(x^2) + eps) * norm), then an epilogue: "store" y (+ bias), "add" y (+ bias) into
# out, or "silu_mul": rows from `row` are gate rows, those from `row2` the matching up rows, and out
# gets silu(gate) * up (rows <= BR/2).
# A narrow tile (narrow=1; no silu_mul) is BR/2 pool rows, each ring chunk two [BR/2, BK] boxes of
# consecutive columns: twice the tiles for a stage with fewer tiles than SMs, chunks as large.
# With amax >= 0 the tile also writes its largest output and that output's arena offset (a float,
# exact below 2^24) to arena[amax], arena[amax + 1] (the first of equal ones): a SAMPLE node
# reduces the tiles' pairs.
# A batch of `batch` rows: x holds them one after another (row b at x + b * k), each normalised on
# its own; row b's outputs go to out + b * ostride and its amax pair to amax + b * astride. (The
# CPU reference and the Gluon kernel run batches; the kernel, up to StreamConfig.batch_rows.)
# Sampling (batch 1, with amax): the int-arena words at samp >= 0 are the row's temperature (float
# bits), its seed's low and high words, the launch's first context length, and the token id of the
# logits' first row (a rank's first token) less their arena offset; at a temperature T > 0 the amax
# pair's value is the largest y / T + G(seed, context length of step s, token id) (philox.py): SAMPLE's
# argmax over the tiles then draws the token from softmax(y / T).
# xbf = 1: x is bf16, already normalised (norm = -1), written by CAST nodes: row b's k values from
# bf16 element 2 * x + b * k of the arena (x: a float offset; k a multiple of 8, so rows stay 16-byte
# aligned), batch * k / 2 floats in all (a batched kernel's every GEMV: StreamConfig.batch_rows).
# obf = 1 (a batched kernel's silu_mul or store GEMV with no bias or amax): the outputs are bf16, row
# b's from bf16 element 2 * out + b * ostride (out a float offset, rows and ostride even), the input of
# a GEMV with xbf and no norm, so no CAST node stands between them.
# A split-K tile (a batched kernel's store GEMV: program.gemv's splits) takes the k pool columns from
# `col` (a multiple of BK) against x's values from column col of each row: x is then the float offset
# of row 0's column col, and `xk` the rows' stride in values (the pool's width; k otherwise). Each
# split stores its partial sums, and the CAST node that reads the output adds them (kinds.CAST part).
# A tall tile (tall = 1: StreamConfig.gemv_tall, a wgmma kernel's; not narrow, not split) is two tiles in
# one: a chunk is two ring slots at one column block, pool rows [row, row + BR) and [row2, row2 + BR),
# one stage of x for both: a store's 2 BR rows (row2 = row + BR), or a silu_mul's BR outputs from BR
# gate rows at row and BR up rows at row2.
GEMV = NodeKind(
    "gemv", 1,
    fields=(Field("pool"), Field("row"), Field("rows"), Field("k"), Field("x"), Field("out"), Field("norm"),
            Field("bias"), Field("epi"), Field("eps", "f32"), Field("narrow"), Field("amax"), Field("row2"),
            Field("batch"), Field("ostride"), Field("astride"), Field("samp"), Field("xbf"), Field("obf"),
            Field("col"), Field("xk"), Field("tall")),
    streamed=Streamed("pool", "row", "k", "row2", "col"), cost=_gemv_cost, footprint=_gemv_footprint)

def _attn_footprint(f: dict, br: int) -> tuple[list, list]:
    reads = [(f["qkv"] + f["head"] * f["hd"], f["group"] * f["hd"]),                    # the group's q heads
             (f["qkv"] + (f["heads"] + f["kvhead"]) * f["hd"], f["hd"]),               # its k head
             (f["qkv"] + (f["heads"] + f["kvheads"] + f["kvhead"]) * f["hd"], f["hd"])]  # its v head
    for name in ("qn", "kn"):
        if f[name] >= 0:
            reads.append((f[name], f["hd"]))
    if f["obf"]:                          # bf16 rows: half a float a value (hd even)
        out = [(f["out"] + f["head"] * f["hd"] // 2, f["group"] * f["hd"] // 2)]
    else:
        out = [(f["out"] + f["head"] * f["hd"], f["group"] * f["hd"])]
    if f["splits"] == 1:
        return reads, out
    writes = [(f["part"] + f["split"] * f["group"] * (f["hd"] + 2), f["group"] * (f["hd"] + 2))]  # its partials
    # whichever share finishes last reads every share's partials and writes out: its ticket orders
    # that after the other shares, which the static check cannot see, so the merge is declared on
    # share 0 alone (every later reader of out descends from all the shares)
    return reads, writes + out if f["split"] == 0 else writes


# One decode token's attention for one KV head and its group of q heads (batch 1): the q and k heads
# of arena qkv are RMS-normed (when qn/kn >= 0) and rotated by the RoPE rows of position `pos`
# (arena cos/sin tables, [positions, hd/2]); the new k and v go to the paged bf16 KV cache (the
# kernel's `kv`, [layers, 2, blocks, bs, kvheads, hd]) at the block table's slot for pos, when the
# write word is >= 0; then softmax(q K^T * scale) V over the n_ctx tokens of the block table, into
# out. The int-arena words at `step` are pos, n_ctx, write, then the block table, for the launch's
# first step: step s of a launch (a decode loop) runs at pos + s over n_ctx + s tokens. Its cost is
# the context's KV bytes, set by the builder (`ctx` tokens). With splits > 1 the node covers share
# `split` of the context and writes its partials (the unnormalised output, the running max and sum
# per q head: group * (hd + 2) floats at part + split * group * (hd + 2)), then takes a ticket (an
# acq_rel atomic add on counter `ticket`, the KV head's own) and the share that takes the head's
# last one merges every share's partials into out before it signals: out is written once all the
# head's shares have signalled. obf = 1 (a batched kernel's): out holds bf16 rows, head h's values from
# bf16 element 2 * out + h * hd, the input of a GEMV with xbf, so no CAST node stands between them.
ATTN = NodeKind(
    "attn", 2,
    fields=(Field("qkv"), Field("out"), Field("head"), Field("kvhead"), Field("group"), Field("heads"),
            Field("kvheads"), Field("hd"), Field("step"), Field("cos"), Field("sin"), Field("qn"), Field("kn"),
            Field("layer"), Field("blocks"), Field("bs"), Field("eps", "f32"), Field("scale", "f32"), Field("ctx"),
            Field("split"), Field("splits"), Field("part"), Field("ticket"), Field("obf")),
    streamed=StreamedKV("layer", "kvhead", "step", "split", "splits", "blocks", "bs"),
    cost=lambda f, br: float(4 * f["hd"] * max(1, f["ctx"] // f["splits"])), footprint=_attn_footprint)
# The token's embedding row: out[:k] = float(emb[ints[token] - first, :k]), emb the kernel's bf16
# [rows, k] table (StreamProgram.embedding); a token outside [first, first + rows) reads row 0 or
# rows - 1, never outside the table (NaN logits leave SAMPLE no largest value), or, with shard = 1
# (tensor parallelism: the table is this rank's share of the vocabulary, from token `first`), zeros:
# an all-reduce then sums the one rank's row with the others' zeros. The first node of a decode step.
EMBED = NodeKind(
    "embed", 4, fields=(Field("token"), Field("out"), Field("k"), Field("rows"), Field("first"), Field("shard")),
    cost=lambda f, br: float(2 * f["k"]), footprint=lambda f, br: ([], [(f["out"], f["k"])]))
# Greedy sampling: of the `count` (value, arena offset) pairs at arena `pairs` (GEMV amax), the
# offset of the largest value, less `base` (the logits' offset), is the token (of equal values, the
# lowest token): written to ints[token] (the next step's EMBED reads it) and ints[tokens + s], s the
# step of the launch. With per > 0 (tensor parallelism) the pairs are the ranks' in turn, `per` a
# rank, each rank's offsets into its own logits, which hold its `shard` tokens of the vocabulary:
# pair i's token is its offset - base + (i // per) * shard.
SAMPLE = NodeKind(
    "sample", 5, fields=(Field("pairs"), Field("count"), Field("base"), Field("token"), Field("tokens"),
                         Field("per"), Field("shard")),
    cost=lambda f, br: float(8 * f["count"]), footprint=lambda f, br: ([(f["pairs"], 2 * f["count"])], []))

# Tensor parallelism: one slice of an all-reduce across the `world` ranks, each running its own
# program of the same shape over its shard of the weights (this one is rank `rank`). Every rank's
# arena holds its partial sum at `src` (n floats: a row-parallel GEMV's output); out[:n] gets their
# sum, taken in rank order so every rank holds the same bits ("store"), or that sum added to out
# ("add": the residual). On a GPU (StreamConfig.tensor_parallel) the ranks' arenas and counters are
# in symmetric memory: each rank bumps counter `meet` (the build gives each slice its own) in every
# peer's counters, waits for the peers' bumps in its own, then reads their partials; the CPU
# reference exchanges them (reference.Exchange).
ALLREDUCE = NodeKind(
    "allreduce", 6, fields=(Field("src"), Field("out"), Field("n"), Field("epi"), Field("world"), Field("rank"),
                            Field("meet")),
    cost=lambda f, br: float(4 * f["n"] * (f["world"] + 1)),
    footprint=lambda f, br: ([(f["src"], f["n"])] + ([(f["out"], f["n"])] if f["epi"] == EPILOGUES["add"] else []),
                             [(f["out"], f["n"])]))

# One row of a GEMV's input, once for every tile that reads it (a batched kernel's): out gets
# x[0:k], RMS-normalised with norm >= 0 (x * rsqrt(mean(x^2) + eps) * norm), rounded to bf16: the
# k bf16 values from bf16 element 2 * out of the arena (k / 2 floats), what a GEMV with xbf reads.
def _cast_footprint(f: dict, br: int) -> tuple[list, list]:
    reads = [(f["x"], f["k"])] + ([(f["norm"], f["k"])] if f["norm"] >= 0 else [])
    reads += [(f["part"] + s * f["pstride"], f["k"]) for s in range(f["parts"])]
    return reads, [(f["out"], f["k"] // 2)] + ([(f["x"], f["k"])] if f["parts"] else [])


MAX_CAST_PARTS = 8            # split-K partials a CAST node adds (program.cast refuses more)
# A batched kernel's GEMV input: row x[:k] (with parts > 0 first x[:k] += the split-K partial sums at
# part + s * pstride, s = 0, 1, ... in turn, written back to x), RMS-normalised with norm >= 0, as bf16
# from bf16 element 2 * out (program.cast).
CAST = NodeKind(
    "cast", 7, fields=(Field("x"), Field("out"), Field("k"), Field("norm"), Field("eps", "f32"), Field("part"),
                       Field("parts"), Field("pstride")),
    cost=lambda f, br: float(6 * f["k"] * (1 + f["parts"])), footprint=_cast_footprint)

KINDS = (NOP, GEMV, ATTN, EMBED, SAMPLE, ALLREDUCE, CAST)      # opcode 3 was COMBINE (merged into ATTN by ticket)
BY_OPCODE = {k.opcode: k for k in KINDS}
BY_NAME = {k.name: k for k in KINDS}


@dataclasses.dataclass(frozen=True)
class Instruction:
    kind: NodeKind
    waits: tuple[tuple[int, int], ...] = ()     # (counter, signals per run)
    signal: int = -1                            # counter bumped when done (-1: none)
    fields: dict = dataclasses.field(default_factory=dict)
    signals: int = 1                            # by how much (the run of tiles this one closes)

    def serialize(self, body=None) -> list[int]:
        """The instruction's words; body: its fields already encoded (kind.encode), if at hand."""
        if len(self.waits) > MAX_WAITS:
            raise ValueError(f"an instruction holds at most {MAX_WAITS} waits (the builder adds NOPs for more)")
        waits = list(self.waits) + [(-1, 0)] * (MAX_WAITS - len(self.waits))
        head = [self.kind.opcode, waits[0][0], waits[0][1], waits[1][0], waits[1][1], self.signal, self.signals]
        body = list(self.kind.encode(self.fields) if body is None else body)
        return head + body + [0] * (WORDS - len(head) - len(body))

    @classmethod
    def parse(cls, words) -> Instruction:
        if len(words) != WORDS:
            raise ValueError(f"an instruction is {WORDS} words, got {len(words)}")
        op = int(words[0])
        if op not in BY_OPCODE:
            raise ValueError(f"unknown opcode {op}")
        kind = BY_OPCODE[op]
        waits = tuple((int(words[1 + 2 * i]), int(words[2 + 2 * i])) for i in range(MAX_WAITS)
                      if int(words[1 + 2 * i]) >= 0)
        return cls(kind, waits, int(words[header_word("signal")]), kind.decode(words),
                   int(words[header_word("signals")]))
