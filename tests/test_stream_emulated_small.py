"""The streaming kernel's bodies of the node kinds with no streamed operand (small.py: CAST, EMBED,
SAMPLE; allreduce.py; sampling.py's noise) run on the CPU (tests/gluon_emulator.py) against the
reference's bits; the streamed kinds' (GEMV tiles, attention) are tests/test_stream_emulated.py's."""
import numpy as np
import pytest
import torch

pytest.importorskip("triton.experimental.gluon")

from gluon_emulator import P, T, emulated  # noqa: E402
from test_stream_emulated import words  # noqa: E402

from warploop.runtime.stream import kernel  # noqa: E402
from warploop.runtime.stream.reference import run_node  # noqa: E402


@pytest.mark.parametrize("epi", ["store", "add"])
def test_allreduce_body_sums_every_ranks_partial_in_rank_order_after_the_peers_bumps(epi):
    """Three ranks' ALLREDUCE bodies (allreduce.py), one after another, each rank's arena and
    counters at made-up addresses in `peers`, as symmetric memory gives them: each rank bumps the
    others' meet counter once, passes its wait once the peers' bumps are in (the first rank's come
    from ranks not yet run, set here as if they had), and leaves out the reference's sum, bit for
    bit; with a peer's bump missing the wait gives up and says where."""
    from gluon_emulator import address

    from warploop.runtime.stream import allreduce
    from warploop.runtime.stream.kinds import ALLREDUCE, EPILOGUES
    world, n, src, out, meet, epoch = 3, 2500, 16, 4096, 2, 5
    rng = np.random.RandomState(0)
    arenas = [rng.randn(8192).astype(np.float32) for _ in range(world)]
    counters = [np.zeros(4, np.int64) for _ in range(world)]
    peers = P(np.array([address(a) for a in arenas] + [address(c) for c in counters], dtype=np.int64))
    want = arenas[0][src:src + n] + arenas[1][src:src + n] + arenas[2][src:src + n]
    if epi == "add":
        want = [want + a[out:out + n] for a in arenas]
    else:
        want = [want] * world
    body = emulated(allreduce.allreduce)
    # the ranks run one after another here: when rank r runs, the ranks before it have bumped its
    # counter (their bodies did), and the ones after it are set here as if they had run ahead
    for r in range(world):
        counters[r][meet] = (world - 1) * epoch + (world - 1 - r)
    fields = lambda r: dict(src=src, out=out, n=n, epi=EPILOGUES[epi], world=world, rank=r, meet=meet)
    for r in range(world):
        before = [int(c[meet]) for c in counters]
        err = P(np.zeros(4, np.int64))
        failed = body(P(arenas[r]), P(counters[r]), peers, words(ALLREDUCE, fields(r)), epoch, 0, 7, 3, err,
                      1 << 10, kernel.CW.value)
        assert failed == 0 and err.buf[0] == 0
        assert [int(c[meet]) - b for c, b in zip(counters, before, strict=True)] == [int(q != r)
                                                                                          for q in range(world)]
    for r in range(world):
        np.testing.assert_array_equal(arenas[r][out:out + n], want[r])
    # a peer that never bumps: the wait gives up after SPIN polls and names the counter, CTA and instruction
    lonely = [np.zeros(4, np.int64) for _ in range(world)]
    peers2 = P(np.array([address(a) for a in arenas] + [address(c) for c in lonely], dtype=np.int64))
    err = P(np.zeros(4, np.int64))
    failed = body(P(arenas[1]), P(lonely[1]), peers2, words(ALLREDUCE, fields(1)), 0, 0, 7, 3, err, 64,
                  kernel.CW.value)
    assert failed == 1 and list(err.buf) == [1, meet, 7, 3]


def test_sample_body_picks_the_lowest_token_of_the_largest_across_ranks_pairs():
    """SAMPLE over two ranks' runs of amax pairs (per 3, shards of 100 tokens), each pair's offset into
    its own rank's logits (base 40): the largest value's token, rank 1's offsets shifted by 100, the
    lowest token of equal values, as the reference picks it; per 0 is one rank's plain offsets."""
    from warploop.runtime.stream import small
    from warploop.runtime.stream.kinds import SAMPLE
    body = emulated(small._sample)
    for per, shard, pairs, want in [
            (3, 100, [(1.0, 41), (5.0, 47), (2.0, 50), (4.0, 42), (5.0, 44), (float("-inf"), 0)], 7),
            (3, 100, [(1.0, 41), (2.0, 47), (2.0, 50), (4.0, 42), (9.0, 44), (float("-inf"), 0)], 104),
            (0, 0, [(3.0, 45), (3.0, 43), (1.0, 41)], 3)]:
        arena = np.zeros(64, np.float32)
        arena[8:8 + 2 * len(pairs)] = np.array(pairs, np.float32).reshape(-1)
        ints = np.zeros(16, np.int64)
        fields = dict(pairs=8, count=len(pairs), base=40, token=2, tokens=4, per=per, shard=shard)
        body(P(arena), P(ints), words(SAMPLE, fields), 1, kernel.CW.value)
        assert ints[2] == ints[5] == want, (pairs, ints[2])


def test_embed_body_gives_a_shards_row_or_zeros():
    """EMBED with a vocabulary shard (first 10, 4 rows): tokens 10..13 give their rows, others zeros;
    without shard a token outside the table reads the nearest row, as before."""
    from warploop.runtime.stream import small
    from warploop.runtime.stream.kinds import EMBED
    body = emulated(small._embed)
    emb = np.arange(4 * 8, dtype=np.float32)
    xidx = T(np.arange(16))
    for token, shard, want in [(11, 1, emb[8:16]), (9, 1, np.zeros(8)), (14, 1, np.zeros(8)), (14, 0, emb[24:32]),
                               (3, 0, emb[0:8])]:
        arena, ints = np.full(32, 7.0, np.float32), np.array([token], np.int64)
        body(P(arena), P(ints), P(emb), words(EMBED, dict(token=0, out=4, k=8, rows=4, first=10, shard=shard)), xidx)
        np.testing.assert_array_equal(arena[4:12], want)


@pytest.mark.parametrize("k", [8, 2048, 2100])
def test_batched_embed_body_gives_the_row_block_by_block(k):
    """A batched kernel's EMBED (_embed_blocks: blocks of CAST_BLOCK values, not the KMAX span): a
    token's row in fp32, a row wider than a block (2,100) whole; a shard's token outside it zeros,
    without shard the nearest row; nothing past the row's k words."""
    from warploop.runtime.stream import small
    from warploop.runtime.stream.kinds import EMBED
    body = emulated(small._embed_blocks)
    emb = np.random.default_rng(1).standard_normal(4 * k).astype(np.float32)
    for token, shard, want in [(11, 1, emb[k:2 * k]), (9, 1, np.zeros(k)), (14, 0, emb[3 * k:]), (3, 0, emb[:k])]:
        arena, ints = np.full(k + 16, 7.0, np.float32), np.array([token], np.int64)
        body(P(arena), P(ints), P(emb), words(EMBED, dict(token=0, out=4, k=k, rows=4, first=10, shard=shard)),
             4096, 4)
        np.testing.assert_array_equal(arena[4:4 + k], want)
        assert (arena[:4] == 7.0).all() and (arena[4 + k:] == 7.0).all()


@pytest.mark.parametrize("k, hd", [(40, 64), (2048, 64), (2104, 64), (4100, 64), (1030, 128), (2048, 128)])
@pytest.mark.parametrize("norm, sk, parts", [(norm, True, parts) for norm in (True, False) for parts in (0, 3, 6)]
                         + [(True, False, 0)])    # a kernel without split-K tiles has no partials to add
def test_cast_body_writes_the_references_bf16_row(norm, sk, parts, k, hd):
    """CAST (a batched kernel's): a row of k floats (with parts, plus that many split-K partials,
    added in split order and written back to the row), RMS-normalised with its weights or not, as
    bf16 in the arena's words from `out` (two a word, the low half first), the reference's bits
    exactly; nothing past the row's k / 2 words. A row wider than the body's block (2,048 values,
    1,024 in a kernel of head size hd 128) is summed block by block, then normalised in a second pass. sk: the merge
    compiled in (a 16-row kernel has none: no partials)."""
    import types as pytypes

    from warploop.runtime.stream import small
    from warploop.runtime.stream.kinds import CAST
    rng = np.random.default_rng(0)
    x, nw, out, part, stride = 8, 8 + k, 8 + 2 * k, 8 + 3 * k, k + 8
    arena = np.full(part + 6 * stride + 16, 9.0, np.float32)
    arena[x:x + k] = rng.standard_normal(k) * 3
    arena[nw:nw + k] = rng.standard_normal(k)
    arena[part:part + 6 * stride] = rng.standard_normal(6 * stride) * 2
    fields = dict(x=x, out=out, k=k, norm=nw if norm else -1, eps=1e-5, part=part if parts else -1, parts=parts,
                  pstride=stride)
    got = arena.copy()
    emulated(small._cast)(P(got), words(CAST, fields), 8192, 4, sk, hd)
    want = torch.from_numpy(arena.copy())
    run_node(None, want, pytypes.SimpleNamespace(kind=CAST, fields=fields))
    np.testing.assert_array_equal(got, want.numpy())
    assert (got[out + k // 2:] == arena[out + k // 2:]).all() and (got[x + k:out] == arena[x + k:out]).all()
    row = torch.from_numpy(arena[x:x + k].copy())
    for s in range(parts):
        row += torch.from_numpy(arena[part + stride * s:part + stride * s + k].copy())
    np.testing.assert_array_equal(got[x:x + k], row.numpy())       # the row, with the partials added
    if norm:
        row = row * torch.rsqrt(row.pow(2).mean() + 1e-5) * torch.from_numpy(arena[nw:nw + k].copy())
    torch.testing.assert_close(torch.from_numpy(got[out:out + k // 2].copy()).view(torch.bfloat16).float(),
                               row.to(torch.bfloat16).float(), rtol=0, atol=0)


@pytest.mark.parametrize("seed, counter", [(7, 12), (2 ** 63 + 5, 2 ** 31 - 1), (123456789012345, 1)])
def test_gumbel_body_draws_philox_s_numbers(seed, counter):
    """The kernel's Gumbel noise (sampling.py: Philox in int64 words) equals philox.gumbel, the numpy
    reference that tests/test_stream_sampling.py checks against Triton's own tl.philox."""
    from warploop.runtime.stream import philox, sampling
    body = emulated(sampling.gumbel)
    idx = np.arange(0, 4096, 7)
    lo, hi = seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF
    as_i32 = lambda v: v - (1 << 32) if v >= 1 << 31 else v        # the int32 words the kernel reads
    with np.errstate(divide="ignore"):
        got = body(T(np.int64(as_i32(lo))), T(np.int64(as_i32(hi))), T(np.int64(counter)), T(idx)).a
    # the words are exact (a wrong one is another number entirely); the logs round as numpy does them
    np.testing.assert_allclose(got, philox.gumbel(seed, counter, idx), rtol=2e-5, atol=1e-6)
