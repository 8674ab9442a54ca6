"""Block manager and prefix cache without a model: sharing, reference counts, LRU eviction, layout."""
from __future__ import annotations

import pytest

from warploop.llm.kv_cache import BlockManager, KVCacheLayout
from warploop.llm.sequence import Sequence


def seq(tokens) -> Sequence:
    return Sequence(list(tokens), None)


def run(blocks: BlockManager, s: Sequence) -> Sequence:
    """Allocate and pretend the whole sequence ran: its full blocks go to the cache."""
    blocks.allocate(s)
    s.num_computed_tokens = len(s)
    blocks.commit(s)
    return s


def test_shared_prefix_blocks_are_referenced_not_copied():
    blocks = BlockManager(num_blocks=8, block_size=4)
    a = run(blocks, seq(range(10)))               # blocks: [0..3] [4..7] [8, 9]
    b = seq([*range(8), 50, 51, 52])
    blocks.allocate(b)
    assert b.block_table[:2] == a.block_table[:2] and b.num_computed_tokens == 8
    assert b.block_table[2] != a.block_table[2]
    assert blocks.num_used == 4
    blocks.free(a)
    assert blocks.num_used == 3                   # the shared two stay referenced by b
    blocks.free(b)
    assert blocks.num_used == 0 and blocks.hit_tokens == 8


def test_the_block_with_the_last_token_always_runs():
    blocks = BlockManager(num_blocks=8, block_size=4)
    run(blocks, seq(range(8)))
    again = seq(range(8))
    blocks.allocate(again)
    assert again.num_computed_tokens == 4         # the second block is recomputed for its logits


def test_idle_cached_blocks_are_evicted_least_recent_first_tails_before_heads():
    blocks = BlockManager(num_blocks=4, block_size=2)
    a = run(blocks, seq([1, 2, 3, 4, 5, 6, 7]))   # 3 full blocks cached + 1 partial
    head = a.block_table[0]
    blocks.free(a)
    assert blocks.num_free == 4 and len(blocks.cache) == 3
    b = seq([9, 9, 9])                            # needs 2 blocks: the free one, then the LRU idle one
    blocks.allocate(b)
    assert len(blocks.cache) == 2                 # a's last full block went first
    blocks.free(b)
    c = seq([1, 2, 3, 4, 8])                      # still finds a's first two blocks
    assert blocks.can_allocate(c)
    blocks.allocate(c)
    assert c.block_table[0] == head and c.num_computed_tokens == 4


def test_prefix_caching_off_never_shares():
    blocks = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    run(blocks, seq(range(10)))
    b = seq(range(10))
    blocks.allocate(b)
    assert b.num_computed_tokens == 0 and blocks.num_used == 6


def test_append_takes_a_block_only_at_a_boundary():
    blocks = BlockManager(num_blocks=3, block_size=4)
    s = seq(range(4))
    blocks.allocate(s)
    s.token_ids.append(4)                         # position 4 needs a second block
    assert blocks.can_append(s)
    blocks.append(s)
    assert len(s.block_table) == 2
    assert blocks.can_append_all([s], ahead=3) and not blocks.can_append_all([s], ahead=8)


def test_kv_layout_round_trips_as_words():
    layout = KVCacheLayout(16, 8192, 16, 8, 64, "bfloat16")
    assert KVCacheLayout.parse(layout.serialize()) == layout
    assert layout.bytes_per_block == 16 * 2 * 16 * 8 * 64 * 2
    with pytest.raises(ValueError, match="dtype"):
        KVCacheLayout(1, 1, 1, 1, 1, "int8")
