"""The megakernel's device-visible data: the step input block and the plan's sizes.

**Step inputs** (int32 words), the graph's one run-time parameter. The host fills it before each
run; every task that needs per-step values reads them from here, so the graph never changes:

| words | field |
|---|---|
| 0 | batch: rows the graph was built for (B) |
| 1 | width: block-table entries per row (W) |
| 2 | rows: live rows this step (n <= B); rows past n are skipped |
| 3 | reserved (0) |
| 4 + [0, B) | token ids |
| 4 + [B, 2B) | positions (of the token being decoded) |
| 4 + [2B, 3B) | context lengths (tokens with KV after this step) |
| 4 + [3B, 4B) | KV slots of the new token (block * block_size + offset) |
| 4 + 4B + [0, B * W) | block tables, row-major |

`STEP_INPUT_FIELDS` names these offsets for the device code (gemv.py, attention.py read them
through `step_*` helpers), so the layout is defined once, here.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import triton
import triton.language as tl

HEADER = 4
F_BATCH, F_WIDTH, F_ROWS = 0, 1, 2


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

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        if not 1 <= n <= self.batch:
            raise ValueError(f"a step of {n} sequences does not fit a graph of batch {self.batch}")
        for name in ("positions", "context_lens", "slots", "block_tables"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"StepInputs.{name} has {len(getattr(self, name))} rows, token_ids {n}")
        longest = max(len(t) for t in self.block_tables)
        if longest > self.width:
            raise ValueError(f"a block table of {longest} blocks exceeds the graph's width {self.width} "
                             "(max_context / block_size)")

    @staticmethod
    def words(batch: int, width: int) -> int:
        return HEADER + 4 * batch + batch * width

    def serialize(self) -> np.ndarray:
        b, n = self.batch, len(self.token_ids)
        out = np.zeros(self.words(b, self.width), dtype=np.int32)
        out[:HEADER] = (b, self.width, n, 0)
        base = HEADER
        for k, values in enumerate((self.token_ids, self.positions, self.context_lens, self.slots)):
            out[base + k * b:base + k * b + n] = values
        out[base + 3 * b + n:base + 4 * b] = -1          # padding rows: no KV slot
        tables = out[base + 4 * b:].reshape(b, self.width)
        for i, table in enumerate(self.block_tables):
            tables[i, :len(table)] = table
        return out

    @classmethod
    def parse(cls, words) -> StepInputs:
        words = np.asarray(words, dtype=np.int32)
        b, w, n = (int(x) for x in words[:3])
        base = HEADER

        def field(k):
            return tuple(int(x) for x in words[base + k * b:base + k * b + n])

        tables = words[base + 4 * b:base + 4 * b + b * w].reshape(b, w)[:n]
        return cls(b, w, field(0), field(1), field(2), field(3), tuple(tuple(int(x) for x in t) for t in tables))


# -- device-side readers of the same layout -----------------------------------------------------------
D_HEADER, D_BATCH, D_WIDTH, D_ROWS = (tl.constexpr(v) for v in (HEADER, F_BATCH, F_WIDTH, F_ROWS))


@triton.jit
def step_rows(inp):
    """Live rows this step."""
    return tl.load(inp + D_ROWS)


@triton.jit
def step_field(inp, k, row):
    """Field k (0 ids, 1 positions, 2 context lengths, 3 slots) of batch row `row`."""
    return tl.load(inp + D_HEADER + k * tl.load(inp + D_BATCH) + row)


@triton.jit
def step_table(inp, row):
    """Pointer to batch row `row`'s block table."""
    b = tl.load(inp + D_BATCH)
    return inp + D_HEADER + 4 * b + row * tl.load(inp + D_WIDTH)


TRITON_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


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

    def __post_init__(self) -> None:
        if self.dtype not in TRITON_DTYPES.values():
            raise ValueError(f"Plan.dtype {self.dtype!r}: use one of {', '.join(TRITON_DTYPES.values())}")
        for name in ("bn", "bk", "rows", "tile"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"Plan.{name} must be a power of two >= 16 (tl.dot's smallest), got {v}")
        if self.splits < 1 or self.heads % self.kv_heads:
            raise ValueError(f"Plan: splits must be >= 1 and heads ({self.heads}) a multiple of kv_heads "
                             f"({self.kv_heads})")

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads

    @property
    def key(self) -> str:
        return (f"{self.dtype}-h{self.heads}-kv{self.kv_heads}-d{self.head_dim}-bs{self.block_size}-s{self.splits}"
                f"-n{self.bn}-k{self.bk}-r{self.rows}-t{self.tile}")

    def constexprs(self) -> dict[str, int]:
        return {"H": self.heads, "KVH": self.kv_heads, "HD": self.head_dim, "HDP": max(16, _pow2(self.head_dim)),
                "HALFP": _pow2(self.head_dim // 2), "GP": max(16, _pow2(self.group)), "GP1": _pow2(self.group + 1),
                "BS": self.block_size, "TILE": self.tile, "S": self.splits, "SP": max(2, _pow2(self.splits)),
                "R": self.rows, "BN": self.bn, "BK": self.bk}
