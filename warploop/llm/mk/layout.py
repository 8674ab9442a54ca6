"""The megakernel's device-visible data: the step input block and the plan's sizes.

**Step inputs** (int32 words), the graph's one run-time parameter. The host fills it before each
run; every task that needs per-step values reads them from here, so the graph never changes:

| words | field |
|---|---|
| 0 | batch: rows the graph was built for (B) |
| 1 | width: block-table entries per row (W) |
| 2 | rows: live rows this step (n <= B); rows past n are skipped |
| 3 | history width: previous-token entries per row (P; 0 when the graph has no room for them) |
| 4 + [0, B) | token ids |
| 4 + [B, 2B) | positions (of the token being decoded) |
| 4 + [2B, 3B) | context lengths (tokens with KV after this step) |
| 4 + [3B, 4B) | KV slots of the new token (block * block_size + offset) |
| 4 + [4B, 5B) | sampling: temperature (float32 bits; 0 = greedy) |
| 4 + [5B, 6B) | sampling: top_k (0 = off) |
| 4 + [6B, 7B) | sampling: top_p (float32 bits; 1 = off) |
| 4 + [7B, 8B) | sampling: min_p (float32 bits; 0 = off) |
| 4 + [8B, 9B) | sampling: repetition penalty (float32 bits; 1 = off) |
| 4 + [9B, 10B), [10B, 11B) | sampling: seed, low and high 32 bits |
| 4 + [11B, 12B) | sampling: step counter (the RNG's second key: a fresh draw every step) |
| 4 + [12B, 13B) | previous tokens listed for the penalty (0 when the row has no penalty) |
| 4 + 13B + [0, B * W) | block tables, row-major |
| 4 + 13B + B * W + [0, B * P) | each row's distinct previous tokens (prompt and output), row-major |

The history comes last so that a step with no penalised row copies only the words before it.

The device code (gemv.py, attention.py, sample.py) reads these offsets through the `step_*`
helpers below, so the layout is defined once, here.
"""
from __future__ import annotations

import dataclasses
import struct

import numpy as np
import triton
import triton.language as tl

HEADER = 4
F_BATCH, F_WIDTH, F_ROWS, F_HISTORY = 0, 1, 2, 3
ROW_FIELDS = 13     # per-row fields before the block tables (the table above)
FLOAT_FIELDS = (4, 6, 7, 8)


@dataclasses.dataclass(frozen=True)
class RowSampling:
    """One row's sampling parameters as the graph reads them (warploop/llm/mk/sample.py)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int = 0
    counter: int = 0

    def __post_init__(self) -> None:
        if not (self.temperature >= 0 and 0 <= self.top_k < 2 ** 31 and 0 < self.top_p <= 1
                and 0 <= self.min_p <= 1 and self.repetition_penalty > 0 and 0 <= self.counter < 2 ** 31):
            raise ValueError(f"RowSampling out of range: {self} (temperature >= 0, top_p in (0, 1], min_p in "
                             "[0, 1], repetition_penalty > 0, top_k and counter in [0, 2**31))")

    def words(self) -> tuple[int, ...]:
        """Fields 4 to 11 of the row, as int32 values (floats by their bits). struct, not numpy:
        this runs per row per decode step on the host."""
        packed = struct.pack("<fifffQi", self.temperature, self.top_k, self.top_p, self.min_p,
                             self.repetition_penalty, self.seed & (2 ** 64 - 1), self.counter)
        return struct.unpack("<8i", packed)

    @classmethod
    def from_words(cls, w) -> RowSampling:
        def f(x):
            return float(np.array(x, dtype=np.int32).view(np.float32))

        seed = int(np.array(w[5:7], dtype=np.int32).view(np.uint32)[0]) | \
            (int(np.array(w[5:7], dtype=np.int32).view(np.uint32)[1]) << 32)
        return cls(f(w[0]), int(w[1]), f(w[2]), f(w[3]), f(w[4]), seed, int(w[7]))


GREEDY = RowSampling()
GREEDY_WORDS = GREEDY.words()


@dataclasses.dataclass(frozen=True)
class StepInputs:
    """One decode step's inputs for a graph of `batch` rows and `width` block-table entries per row."""

    batch: int
    width: int
    token_ids: tuple[int, ...]
    positions: tuple[int, ...]
    context_lens: tuple[int, ...]
    slots: tuple[int, ...]
    block_tables: tuple[tuple[int, ...], ...]
    sampling: tuple[RowSampling, ...] = ()             # per row; () = greedy for every row
    history: tuple[tuple[int, ...], ...] = ()          # per row: distinct previous tokens; () = none
    history_width: int = 0                             # P: entries per row the block has room for

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        if not 1 <= n <= self.batch:
            raise ValueError(f"a step of {n} sequences does not fit a graph of batch {self.batch}")
        for name in ("positions", "context_lens", "slots", "block_tables"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"StepInputs.{name} has {len(getattr(self, name))} rows, token_ids {n}")
        for name in ("sampling", "history"):
            if len(getattr(self, name)) not in (0, n):
                raise ValueError(f"StepInputs.{name} has {len(getattr(self, name))} rows, token_ids {n}")
        most = max((len(h) for h in self.history), default=0)
        if most > self.history_width:
            raise ValueError(f"a history of {most} tokens exceeds the graph's history width {self.history_width} "
                             "(max_context)")
        longest = max(len(t) for t in self.block_tables)
        if longest > self.width:
            raise ValueError(f"a block table of {longest} blocks exceeds the graph's width {self.width} "
                             "(max_context / block_size)")

    @staticmethod
    def words(batch: int, width: int, history_width: int = 0) -> int:
        return StepInputs.history_start(batch, width) + batch * history_width

    @staticmethod
    def history_start(batch: int, width: int) -> int:
        return HEADER + ROW_FIELDS * batch + batch * width

    @property
    def used_words(self) -> int:
        """The prefix the device needs: the history only when some row has previous tokens listed."""
        if any(self.history):
            return self.words(self.batch, self.width, self.history_width)
        return self.history_start(self.batch, self.width)

    def serialize(self) -> np.ndarray:
        b, n = self.batch, len(self.token_ids)
        out = np.zeros(self.words(b, self.width, self.history_width), dtype=np.int32)
        out[:HEADER] = (b, self.width, n, self.history_width)
        base = HEADER
        for k, values in enumerate((self.token_ids, self.positions, self.context_lens, self.slots)):
            out[base + k * b:base + k * b + n] = values
        out[base + 3 * b + n:base + 4 * b] = -1          # padding rows: no KV slot
        rows = np.array([s.words() for s in self.sampling] if self.sampling else [GREEDY_WORDS] * n,
                        dtype=np.int32)   # [n, 8]
        for k in range(8):
            out[base + (4 + k) * b:base + (4 + k) * b + n] = rows[:, k]
        for i, h in enumerate(self.history):
            out[base + 12 * b + i] = len(h)
        tables = out[base + ROW_FIELDS * b:self.history_start(b, self.width)].reshape(b, self.width)
        for i, table in enumerate(self.block_tables):
            tables[i, :len(table)] = table
        hist = out[self.history_start(b, self.width):].reshape(b, self.history_width)
        for i, h in enumerate(self.history):
            hist[i, :len(h)] = h
        return out

    @classmethod
    def parse(cls, words) -> StepInputs:
        words = np.asarray(words, dtype=np.int32)
        b, w, n, p = (int(x) for x in words[:4])
        base = HEADER

        def field(k):
            return tuple(int(x) for x in words[base + k * b:base + k * b + n])

        start = cls.history_start(b, w)
        tables = words[base + ROW_FIELDS * b:start].reshape(b, w)[:n]
        sampling = tuple(RowSampling.from_words([field(k)[i] for k in range(4, 12)]) for i in range(n))
        counts = field(12)
        hist = words[start:start + b * p].reshape(b, p)[:n] if p else np.zeros((n, 0), np.int32)
        history = tuple(tuple(int(x) for x in hist[i, :counts[i]]) for i in range(n)) if any(counts) else ()
        return cls(b, w, field(0), field(1), field(2), field(3), tuple(tuple(int(x) for x in t) for t in tables),
                   sampling, history, p)


# -- device-side readers of the same layout -----------------------------------------------------------
D_HEADER, D_BATCH, D_WIDTH, D_ROWS, D_HISTORY, D_ROW_FIELDS = (
    tl.constexpr(v) for v in (HEADER, F_BATCH, F_WIDTH, F_ROWS, F_HISTORY, ROW_FIELDS))


@triton.jit
def step_rows(inp):
    """Live rows this step."""
    return tl.load(inp + D_ROWS)


@triton.jit
def step_field(inp, k, row):
    """Field k (0 ids, 1 positions, 2 context lengths, 3 slots, 4-12 sampling) of batch row `row`."""
    return tl.load(inp + D_HEADER + k * tl.load(inp + D_BATCH) + row)


@triton.jit
def step_float(inp, k, row):
    """A float32 field (temperature 4, top_p 6, min_p 7, repetition penalty 8) of batch row `row`."""
    return step_field(inp, k, row).to(tl.float32, bitcast=True)


@triton.jit
def step_history(inp, row):
    """Pointer to batch row `row`'s distinct previous tokens (step_field(inp, 12, row) of them)."""
    b = tl.load(inp + D_BATCH)
    return inp + D_HEADER + D_ROW_FIELDS * b + b * tl.load(inp + D_WIDTH) + row * tl.load(inp + D_HISTORY)


@triton.jit
def step_table(inp, row):
    """Pointer to batch row `row`'s block table."""
    b = tl.load(inp + D_BATCH)
    return inp + D_HEADER + D_ROW_FIELDS * b + row * tl.load(inp + D_WIDTH)


TRITON_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


TILE_CHUNKS = 8         # weight loads per GEMV tile: all in flight at once (gemv_tile.py)


def _pow2_floor(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


@dataclasses.dataclass(frozen=True)
class Plan:
    """What the graph's tasks are compiled for: the model's shapes and the tile sizes, all constexprs
    (one resident kernel per plan, as a per-model megakernel). `key` names the plan in task names."""

    dtype: str              # Triton's name: bf16, fp16, fp32
    heads: int
    kv_heads: int
    head_dim: int
    block_size: int
    splits: int = 2         # S: context splits per KV head in decode attention
    bn: int = 16            # weight rows per GEMV block
    bk: int = 128           # columns per GEMV chunk
    rows: int = 16          # batch rows per tl.dot block (>= 16)
    tile: int = 64          # context tokens per attention step
    candidates: int = 32    # KC: top tokens each sampling tile keeps, and the combine merges (top-k/p/min-p)
    hidden: int = 0         # the model's hidden and intermediate sizes as GEMV widths (KD, KQ, KF): with
    inter: int = 0          # them the GEMVs are tiles over constant widths (the GPU plan); 0: run-time widths
    depth: int = 4          # a GEMV tile's weight chunks issued before its wait (4 or 8)
    tile_kb: int = 0        # with widths: KB of weights per GEMV tile (one node each, TILE_CHUNKS loads)
    one_row: int = 0        # 1: a kernel for the batch-1 graph only: its GEMV tiles carry no batch path (fewer
    #                         registers, no shared memory for tl.dot blocks); batches run on another kernel

    def __post_init__(self) -> None:
        if self.dtype not in TRITON_DTYPES.values():
            raise ValueError(f"Plan.dtype {self.dtype!r}: use one of {', '.join(TRITON_DTYPES.values())}")
        for name in ("bn", "bk", "rows", "tile", "candidates"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"Plan.{name} must be a power of two >= 16 (tl.dot's smallest), got {v}")
        if self.hidden < 0 or self.inter < 0 or bool(self.hidden) != bool(self.inter):
            raise ValueError(f"Plan: hidden ({self.hidden}) and inter ({self.inter}) are both the model's widths "
                             "or both 0 (run-time widths)")
        if bool(self.tile_kb) != bool(self.hidden) or self.tile_kb and (self.tile_kb < 4 or
                                                                          self.tile_kb & (self.tile_kb - 1)):
            raise ValueError(f"Plan.tile_kb must be a power of two >= 4 with the widths set (the GPU plan's GEMV "
                             f"tiles) and 0 without them (the CPU plan's run-time widths), got {self.tile_kb} "
                             f"with hidden {self.hidden}")
        if self.one_row not in (0, 1):
            raise ValueError(f"Plan.one_row must be 0 or 1, got {self.one_row}")
        if self.one_row and not self.tile_kb:
            raise ValueError("Plan.one_row (a batch-1 kernel) needs GEMV tiles (tile_kb set, the GPU plan)")
        if self.depth not in (4, 8):
            raise ValueError(f"Plan.depth must be 4 or 8 (weight chunks in flight), got {self.depth}")
        if self.splits < 1 or self.heads % self.kv_heads:
            raise ValueError(f"Plan: splits must be >= 1 and heads ({self.heads}) a multiple of kv_heads "
                             f"({self.kv_heads})")

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads

    @property
    def key(self) -> str:
        return (f"{self.dtype}-h{self.heads}-kv{self.kv_heads}-d{self.head_dim}-bs{self.block_size}-s{self.splits}"
                f"-n{self.bn}-k{self.bk}-r{self.rows}-t{self.tile}-c{self.candidates}"
                + (f"-w{self.hidden}-f{self.inter}-a{self.depth}" if self.hidden else "")
                + (f"-T{self.tile_kb}" if self.tile_kb else "")
                + ("-1" if self.one_row else ""))

    @property
    def elem(self) -> int:
        return 4 if self.dtype == "fp32" else 2

    def gemv_tile(self, k: int, sub: int = 1) -> tuple[int, int]:
        """(TN, TK) of a GEMV tile over width k: TN weight rows (a power of two; `sub` blocks of them,
        2 for gate and up) of about tile_kb KB in all, read as at most TILE_CHUNKS loads of [TN, TK]
        (TK a power of two >= 16; the last chunk of a row masked where TK does not divide k).
        (0, 0) without tiles."""
        if not self.tile_kb:
            return 0, 0
        tn = _pow2_floor(max(1, (self.tile_kb << 10) // (sub * k * self.elem)))
        tk = max(16, _pow2(-(-k // (TILE_CHUNKS // sub))))
        return tn, tk

    def constexprs(self) -> dict[str, int]:
        # HALFP, GP1: operands of rope_attn's tl.dot over half heads (>= 16 each way)
        return {"H": self.heads, "KVH": self.kv_heads, "HD": self.head_dim, "HDP": max(16, _pow2(self.head_dim)),
                "HALFP": max(16, _pow2(self.head_dim // 2)), "GP": max(16, _pow2(self.group)),
                "GP1": max(16, _pow2(self.group + 1)),
                "BS": self.block_size, "TILE": self.tile, "S": self.splits, "SP": max(2, _pow2(self.splits)),
                "R": self.rows, "BN": self.bn, "BK": self.bk, "KC": self.candidates, "KD": self.hidden,
                "KQ": self.heads * self.head_dim if self.hidden else 0, "KF": self.inter, "DEPTH": self.depth,
                "ONE": self.one_row, **self.tile_constexprs()}

    def tile_constexprs(self) -> dict[str, int]:
        """Each GEMV's tile (TN*, TK*; 0 without tiles): D over the hidden width (qkv, lm_head), S the
        same for gate_up (gate and up rows), Q over heads x head_dim (o_proj), F over the
        intermediate width (down)."""
        q = self.heads * self.head_dim
        (tnd, tkd), (tns, tks), (tnq, tkq), (tnf, tkf) = (
            self.gemv_tile(self.hidden), self.gemv_tile(self.hidden, 2), self.gemv_tile(q), self.gemv_tile(self.inter))
        return {"TND": tnd, "TKD": tkd, "TNS": tns, "TKS": tks, "TNQ": tnq, "TKQ": tkq, "TNF": tnf, "TKF": tkf}
