"""The paged KV cache: its device layout, and the block manager that hands out blocks to sequences.

Each sequence owns a block table (list of block ids); token position p lives in block
table[p // block_size] at offset p % block_size. Full blocks are offered to the prefix cache
so later sequences with the same prefix share them instead of recomputing.
"""
from __future__ import annotations

import dataclasses
from collections import deque

from warploop.llm.prefix_cache import PrefixCache, block_key

DTYPE_CODES = {"float32": 0, "bfloat16": 1, "float16": 2}


@dataclasses.dataclass(frozen=True)
class KVCacheLayout:
    """One tensor per model: [num_layers, 2 (k, v), num_blocks, block_size, num_kv_heads, head_dim],
    row-major. A slot (block * block_size + offset) indexes [slot, num_kv_heads, head_dim] rows."""

    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_CODES:
            raise ValueError(f"KV cache dtype {self.dtype!r}: use one of {', '.join(DTYPE_CODES)}")
        for name in ("num_layers", "num_blocks", "block_size", "num_kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"KVCacheLayout.{name} must be positive, got {getattr(self, name)}")

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.num_layers, 2, self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def bytes_per_block(self) -> int:
        itemsize = 4 if self.dtype == "float32" else 2
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim * itemsize

    def serialize(self) -> list[int]:
        """int32 words, in field order, with the dtype as its code (what device code decodes)."""
        return [self.num_layers, self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim,
                DTYPE_CODES[self.dtype]]

    @classmethod
    def parse(cls, words: list[int]) -> KVCacheLayout:
        names = {code: name for name, code in DTYPE_CODES.items()}
        return cls(*words[:5], dtype=names[words[5]])


def cdiv(a: int, b: int) -> int:
    return -(a // -b)


class BlockManager:
    """Block allocation with reference counts; idle cached blocks are evicted LRU when memory runs out."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self._refs = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self.cache = PrefixCache() if enable_prefix_caching else None
        self.hit_tokens = 0

    @property
    def num_free(self) -> int:
        """Blocks a new allocation can get: never used, or cached but unreferenced."""
        return len(self._free) + (self.cache.num_idle if self.cache else 0)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def can_allocate(self, seq) -> bool:
        return cdiv(len(seq.token_ids), self.block_size) <= self.num_free

    def allocate(self, seq) -> None:
        """Give `seq` blocks for all its tokens, reusing cached blocks of its prefix. The block that
        holds the last token is never taken from the cache: that token must run to produce logits."""
        assert not seq.block_table, "sequence already has blocks"
        tokens, bs = seq.token_ids, self.block_size
        key = None
        if self.cache is not None:
            for i in range((len(tokens) - 1) // bs):
                chunk = tokens[i * bs:(i + 1) * bs]
                key = block_key(key, chunk)
                block = self.cache.lookup(key, chunk)
                if block is None:
                    break
                self._reference(block)
                seq.block_table.append(block)
                seq.block_keys.append(key)
        seq.num_computed_tokens = len(seq.block_table) * bs
        self.hit_tokens += seq.num_computed_tokens
        while len(seq.block_table) * bs < len(tokens):
            seq.block_table.append(self._take())

    def can_append(self, seq) -> bool:
        return self._blocks_needed(seq, 0) <= self.num_free

    def can_append_all(self, seqs, ahead: int) -> bool:
        """Room for each sequence's newest token plus `ahead` tokens not yet on the host."""
        return sum(self._blocks_needed(seq, ahead) for seq in seqs) <= self.num_free

    def append(self, seq, ahead: int = 0) -> None:
        """Make room for the KV of the sequence's newest token (and `ahead` more)."""
        for _ in range(self._blocks_needed(seq, ahead)):
            seq.block_table.append(self._take())

    def _blocks_needed(self, seq, ahead: int) -> int:
        return max(0, cdiv(len(seq.token_ids) + ahead, self.block_size) - len(seq.block_table))

    def commit(self, seq) -> None:
        """Offer the sequence's newly filled blocks to the prefix cache."""
        if self.cache is None:
            return
        bs = self.block_size
        for i in range(len(seq.block_keys), seq.num_computed_tokens // bs):
            chunk = seq.token_ids[i * bs:(i + 1) * bs]
            key = block_key(seq.block_keys[-1] if seq.block_keys else None, chunk)
            self.cache.insert(key, seq.block_table[i], chunk)
            seq.block_keys.append(key)

    def free(self, seq) -> None:
        """Drop the sequence's references; the last blocks go first to the eviction list, so a
        shared prefix outlives the tails that followed it."""
        for block in reversed(seq.block_table):
            self._refs[block] -= 1
            if self._refs[block] == 0:
                if self.cache is not None and self.cache.holds(block):
                    self.cache.release(block)
                else:
                    self._free.append(block)
        seq.block_table.clear()
        seq.block_keys.clear()
        seq.num_computed_tokens = 0

    def lend(self, n: int) -> list[int]:
        """Take `n` blocks for the device to hand out (a decode loop's free list); each comes back
        through a sequence's table (adopted: it is the sequence's reference) or give_back."""
        if n > self.num_free:
            raise RuntimeError(f"cannot lend {n} KV blocks: {self.num_free} are free")
        return [self._take() for _ in range(n)]

    def give_back(self, blocks) -> None:
        """Return lent blocks no sequence took."""
        for block in blocks:
            if self._refs[block] != 1:
                raise RuntimeError(f"KV block {block} is not a lent block ({self._refs[block]} references)")
            self._refs[block] = 0
            self._free.appendleft(block)

    def _reference(self, block: int) -> None:
        if self._refs[block] == 0:
            self.cache.reuse(block)
        self._refs[block] += 1

    def _take(self) -> int:
        if self._free:
            block = self._free.popleft()
        elif self.cache is not None and self.cache.num_idle:
            block = self.cache.evict()
        else:
            raise RuntimeError("KV cache out of blocks (the scheduler should have preempted)")
        self._refs[block] = 1
        return block
