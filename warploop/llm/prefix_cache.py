"""Prefix cache: full KV blocks found again by the tokens that lead up to them.

A block's key hashes the key of the block before it with the block's own tokens, so a key stands
for the whole prefix up to the block's end. Blocks are shared by reference count (kept by the
BlockManager); a cached block nobody references stays in the cache, on an LRU list, until its
memory is needed for a new block.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


def block_key(parent: int | None, tokens: Sequence[int]) -> int:
    """The key of a full block whose preceding block has key `parent` (None for the first)."""
    return hash((parent, tuple(tokens)))


class PrefixCache:
    def __init__(self) -> None:
        self._block_of: dict[int, int] = {}           # key -> block
        self._key_of: dict[int, int] = {}             # block -> key
        self._tokens_of: dict[int, tuple[int, ...]] = {}
        self._idle: OrderedDict[int, None] = OrderedDict()   # unreferenced cached blocks, oldest first

    def __len__(self) -> int:
        return len(self._key_of)

    @property
    def num_idle(self) -> int:
        return len(self._idle)

    def lookup(self, key: int, tokens: Sequence[int]) -> int | None:
        """The block cached under `key`; the tokens are compared too, so a hash collision misses."""
        block = self._block_of.get(key)
        if block is None or self._tokens_of[block] != tuple(tokens):
            return None
        return block

    def insert(self, key: int, block: int, tokens: Sequence[int]) -> bool:
        """Cache a just-filled block. False if another block already holds this prefix."""
        if key in self._block_of or block in self._key_of:
            return False
        self._block_of[key], self._key_of[block], self._tokens_of[block] = block, key, tuple(tokens)
        return True

    def holds(self, block: int) -> bool:
        return block in self._key_of

    def release(self, block: int) -> None:
        """The last reference to a cached block went away: it becomes the newest eviction candidate."""
        self._idle[block] = None
        self._idle.move_to_end(block)

    def reuse(self, block: int) -> None:
        """A cached block is referenced again: it may no longer be evicted."""
        self._idle.pop(block, None)

    def evict(self) -> int:
        """Forget the least recently released idle block and hand its memory back."""
        block, _ = self._idle.popitem(last=False)
        del self._block_of[self._key_of.pop(block)]
        del self._tokens_of[block]
        return block
