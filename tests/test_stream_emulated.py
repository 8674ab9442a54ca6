"""The streaming kernel's Gluon bodies run on the CPU (tests/gluon_emulator.py) inside a decoder's
program, the ring filled as the loader fills it, every other node run by the CPU reference; the
arena and the KV cache they leave against the reference's. This checks what the bodies compute
(indices, masks, the ring's chunk count, the online softmax) before any GPU run; the GPU tests
check the rest (tests/test_stream_gpu.py)."""
import numpy as np
import pytest
import torch

pytest.importorskip("triton.experimental.gluon")

from gluon_emulator import P, S, T, emulated  # noqa: E402
from test_stream_step import bf16_exact_weights  # noqa: E402

from warploop.llm.config import ModelConfig  # noqa: E402
from warploop.llm.kv_cache import cdiv  # noqa: E402
from warploop.llm.stream_step import StreamDecoder, batch_rows, stream_config  # noqa: E402
from warploop.runtime.stream import attention, gemv_rows, kernel  # noqa: E402
from warploop.runtime.stream.kinds import ATTN, GEMV, HEADER  # noqa: E402
from warploop.runtime.stream.reference import reference, run_node  # noqa: E402

MODELS = {
    "qwen3_hd16": ModelConfig(family="qwen3", vocab_size=200, hidden_size=192, intermediate_size=320, num_layers=2,
                              num_heads=8, num_kv_heads=2, head_dim=16, qk_norm=True, o_bias=True),
    "llama_hd64": ModelConfig(family="llama", vocab_size=300, hidden_size=256, intermediate_size=384, num_layers=1,
                              num_heads=4, num_kv_heads=1, head_dim=64, tie_word_embeddings=False),
    "llama_hd128": ModelConfig(family="llama", vocab_size=96, hidden_size=256, intermediate_size=96, num_layers=1,
                               num_heads=6, num_kv_heads=2, head_dim=128, tie_word_embeddings=False),
}
SPIN = 1 << 20


def words(kind, fields) -> P:
    """An instruction's words (the header zeros: the emulated waits take their values as arguments)."""
    return P(np.array([0] * len(HEADER) + list(kind.encode(fields)), dtype=np.int64))


def gemv_chunks(program, f, br: int, bk: int) -> np.ndarray:
    """The ring chunks the loader streams for a GEMV tile: [chunks, BR, BK], two [BR/2, BK] boxes
    each (rows from row and row2 at one column block, or a narrow tile's at two), out-of-bounds
    rows and columns zero as TMA reads them."""
    pool = program.pools[f["pool"]].float().numpy()
    half, chunks, kk = br // 2, [], f["col"]
    while kk < f["col"] + f["k"]:
        # a tall tile's chunk: two slots, rows [row, row + BR) then [row2, row2 + BR)
        slots = [((f["row"], kk), (f["row"] + half, kk)), ((f["row2"], kk), (f["row2"] + half, kk))] if f["tall"] \
            else [((f["row"], kk), (f["row2"], kk + bk * f["narrow"]))]
        for boxes in slots:
            c = np.zeros((br, bk), np.float32)
            for h, (row, col) in enumerate(boxes):
                box = pool[row:row + half, col:col + bk]
                c[h * half:h * half + box.shape[0], :box.shape[1]] = box
            chunks.append(c)
        kk += bk * (1 + f["narrow"])
    return np.stack(chunks)


def step_words(dec, rows: list[tuple[int, list[int]]]) -> list[int]:
    """The step region's words: each row's position, context length, write flag and block table."""
    out = []
    for pos, table in rows:
        out += [pos, pos + 1, 0] + table + [0] * (dec.step_words - 3 - len(table))
    return out


@pytest.mark.parametrize("batch", [2, 17, 32])
@pytest.mark.parametrize("block_rows, block_k, pipe", [(32, 128, False), (64, 128, False), (64, 128, True),
                                                      (64, 128, "tall")])
@pytest.mark.parametrize("name", ["qwen3_hd16", "llama_hd64"])
def test_gemv_rows_body_gives_the_reference_outputs(name, block_rows, block_k, pipe, batch, monkeypatch):
    """Every batched GEMV of a decoder's step (qkv with its narrow tiles, o_proj with bias and add,
    gate/up with SiLU, down, lm_head with each row's amax pair) through gemv_rows, reading CAST
    nodes' bf16 rows as they are (tiles of 64 rows: on wgmma; pipe: StreamConfig.wgmma_pipe, each
    chunk's stages refilled once the chunk after it has issued; "tall": StreamConfig.gemv_tall, gate/up and the
    lm_head as tall tiles, forced here for these small shapes): the arena within fp32 accumulation of the
    reference's."""
    if pipe == "tall":
        from warploop.llm import stream_record
        monkeypatch.setattr(stream_record, "tall", lambda rows, config, ctas=132, silu=False: config.gemv_tall)
    assert check_gemv_rows(MODELS[name], block_rows, block_k, batch, pipe=pipe) > 4 * MODELS[name].num_layers


@pytest.mark.parametrize("block_rows, block_k", [(64, 128)])
def test_split_k_tiles_through_the_gemv_rows_body_give_the_reference_outputs(block_rows, block_k, monkeypatch):
    """o_proj and down split K (forced to one chunk a split): each split's tiles stream their own
    columns (col) and read x's rows at their stride (xk), storing partial sums the reference's."""
    from warploop.llm import stream_record
    monkeypatch.setattr(stream_record, "KSPLIT_CHUNKS", 1)
    assert check_gemv_rows(MODELS["llama_hd64"], block_rows, block_k, 17, splits=True) > 4


def check_gemv_rows(cfg, block_rows: int, block_k: int, batch: int, splits: bool = False, pipe=False) -> int:
    """test_gemv_rows_body_gives_the_reference_outputs's check; returns the GEMVs it ran (with
    splits, the split-K tiles: at least one must be in the program)."""
    w = bf16_exact_weights(cfg)
    config = stream_config(cfg, block_rows=block_rows, block_k=block_k, batch_rows=batch_rows(batch),
                           wgmma_pipe=pipe is True, gemv_tall=pipe == "tall")
    dec = StreamDecoder(cfg, w, max_context=32, block_size=4, batch=batch, config=config)
    p = dec.program
    ints = p.int_arena()
    words_ = step_words(dec, [(3 + b % 5, [b % 2 * 4 + j for j in range(4)]) for b in range(batch)])
    r = p.int_regions["step"]
    ints[r.offset:r.offset + len(words_)] = torch.tensor(words_, dtype=torch.int32)
    r = p.int_regions["token"]
    ints[r.offset:r.offset + batch] = torch.arange(batch, dtype=torch.int32) % cfg.vocab_size
    kv = torch.randn(p.kv.shape, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    # node by node from the reference's own arena: each batched GEMV runs the body on a copy of it
    # and its outputs are compared at once (x times the norm weights is rounded to bf16 on both sides,
    # so a GEMV fed another's fp32 order could flip a rounding: each is fed the same input)
    arena, ints_r, kv_r, ran, tall = p.arena(), ints.clone(), kv.clone(), 0, 0
    body = emulated(gemv_rows.gemv_rows, waits=lambda *a: a[7], _barrier=lambda: None)
    for node in p.nodes:
        f = node.fields
        if node.kind is not GEMV or f["batch"] == 1:
            run_node(p, arena, node, ints_r, kv_r, 0)
            continue
        # a batched kernel's slot: [BK / SB, BR, SB] column blocks (the loader's swizzled boxes)
        ring = gemv_chunks(p, f, block_rows, block_k)
        ring = ring.reshape(len(ring), block_rows, -1, gemv_rows.SB.value).transpose(0, 2, 1, 3).copy()
        none = S(np.zeros((len(ring), 1)))
        xs = S(np.full((config.x_rows, block_k), np.nan, np.float32))
        got = arena.clone()
        it, failed = body(S(ring), none, none, xs, 0, words(GEMV, f), P(got.numpy()), None, None, 0, 0, 0, 0,
                          None, -1, 0, -1, 0, T(f["k"]), T(f["x"]), T(f["rows"]), T(f["out"]), T(f["bias"]),
                          T(f["epi"]), T(f["narrow"]), T(f["batch"]), block_rows, block_k, len(ring), SPIN, False,
                          config.batch_rows, kernel.CW.value, config.x_stages, config.wgmma_pipe,
                          config.gemv_tall)
        assert int(it) == len(ring) and failed == 0
        tall += f["tall"]
        run_node(p, arena, node, ints_r, kv_r, 0)
        # only fp32 summation order differs
        torch.testing.assert_close(got, arena, rtol=1e-4, atol=1e-4)
        ran += 1 if not splits or f["k"] < f["xk"] else 0
    assert bool(tall) == config.gemv_tall                # tall tiles ran where the kernel has them
    return ran


def kv_chunks(f, cache: np.ndarray, ints: np.ndarray, config, lo: int, hi: int, launch_pos: int) -> np.ndarray:
    """The ring chunks stream_kv fills for a share [lo, hi): the keys then the values of each chunk,
    in boxes of up to a block; a box past hi is zeros; rows this launch wrote are what TMA read
    before the writes (stale: NaN here), rows of a box past hi what the cache holds there."""
    hd, kvt = config.head_dim, config.kv_tokens
    bs = cache.shape[3]
    kvb = config.kv_box(bs)
    nsub, chunks, t0 = kvt // kvb, [], lo
    kw = config.kv_width            # kv_split: the keys' slot, then the values', each [hd / kw, kvt, kw]
    while t0 < hi:
        slot = np.zeros((2, hd // kw, nsub, kvb, kw), np.float32)
        for j in range(nsub):
            t = t0 + j * kvb
            if t < hi:
                blk = int(ints[f["step"] + 3 + t // bs])
                for which in (0, 1):
                    rows = cache[f["layer"], which, blk, t % bs:t % bs + kvb, f["kvhead"]].copy()
                    toks = t + np.arange(kvb)
                    rows[(toks >= launch_pos) & (toks < hi)] = np.nan
                    slot[which, :, j] = rows.reshape(kvb, hd // kw, kw).transpose(1, 0, 2)
        for part in (slot[0], slot[1]) if config.kv_split else (slot,):
            flat = np.zeros(config.block_rows * config.block_k, np.float32)
            flat[:part.size] = part.reshape(-1)
            chunks.append(flat.reshape(config.block_rows, config.block_k))
        t0 += kvt
    return np.stack(chunks) if chunks else np.zeros((1, config.block_rows, config.block_k), np.float32)


@pytest.mark.parametrize("block_rows, block_k", [(32, 128), (64, 128)])
def test_gemv_rows_body_stores_bf16_rows_as_the_reference(block_rows, block_k):
    """A batched GEMV with epi "store" and bf16 outputs (obf: what no decoder step records today,
    program.gemv accepts it) through gemv_rows: its tiles' bf16 rows equal the reference's."""
    from warploop.runtime.stream.compiled import StreamConfig
    from warploop.runtime.stream.program import StreamProgram
    config = StreamConfig(block_rows=block_rows, block_k=block_k, kmax=256, batch_rows=16)
    p = StreamProgram(config)
    g = torch.Generator().manual_seed(3)
    k, n, batch = 256, 96, 5
    pool = p.pool(torch.randn(n, k, generator=g).to(torch.bfloat16))
    x = p.buffer("x", batch * k // 2, init=torch.randn(batch * k, generator=g).to(torch.bfloat16).view(torch.float32))
    y = p.buffer("y", batch * n // 2)
    p.gemv(pool, 0, n, x, y, batch=batch, xbf=True, obf=True)
    want = reference(p, p.arena())
    got = p.arena()
    body = emulated(gemv_rows.gemv_rows, waits=lambda *a: a[7], _barrier=lambda: None)
    for node in p.nodes:
        f = node.fields
        ring = gemv_chunks(p, f, block_rows, block_k)
        ring = ring.reshape(len(ring), block_rows, -1, gemv_rows.SB.value).transpose(0, 2, 1, 3).copy()
        none = S(np.zeros((len(ring), 1)))
        xs = S(np.full((config.x_rows, block_k), np.nan, np.float32))
        it, failed = body(S(ring), none, none, xs, 0, words(GEMV, f), P(got.numpy()), None, None, 0, 0, 0, 0,
                          None, -1, 0, -1, 0, T(f["k"]), T(f["x"]), T(f["rows"]), T(f["out"]), T(f["bias"]),
                          T(f["epi"]), T(f["narrow"]), T(f["batch"]), block_rows, block_k, len(ring), SPIN, False,
                          config.batch_rows, kernel.CW.value, config.x_stages, False, False)
        assert int(it) == len(ring) and failed == 0
    r = p.regions["y"]
    out = lambda a: a[r.offset:r.offset + r.size].view(torch.bfloat16).float()
    assert out(want).abs().sum() > 0
    torch.testing.assert_close(out(got), out(want), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("pos, steps", [(0, 1), (5, 3), (70, 9), (90, 9)])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("name, obf, aw", [("qwen3_hd16", False, False), ("llama_hd128", False, False),
                                           ("qwen3_hd16", True, False), ("llama_hd64", True, True),
                                           ("llama_hd128", True, True), ("llama_hd64", True, "kv_split")])
def test_attention_body_gives_the_reference_outputs(name, obf, aw, splits, pos, steps):
    """A launch of several steps with every ATTN node through attn: RoPE, the KV write, this
    launch's rows patched over the ring's stale copies, the new token's, rows past the share kept
    out (the cache holds NaN past the context), the shares' partials and their merge; arena and
    cache against the reference's. obf: the nodes write bf16 rows (a batched kernel's, kinds.ATTN),
    set on a batch-1 program's nodes here, the reference doing the same. aw: the products on
    wgmma (StreamConfig.attn_wgmma, a batched kernel's chunks); "kv_split": at head_dim 64 too, a chunk's
    128 keys in a slot and its values in the next (StreamConfig.attn_kv_split)."""
    cfg = MODELS[name]
    w = bf16_exact_weights(cfg)
    config = stream_config(cfg, batch_rows=32, attn_wgmma=True, attn_kv_split=aw == "kv_split") if aw \
        else stream_config(cfg)
    bs = 16 if aw else 4                  # attn_wgmma's swizzled boxes take 8 rows or more
    dec = StreamDecoder(cfg, w, max_context=128, block_size=bs, splits=splits, config=config)
    p = dec.program
    for node in p.nodes:
        if obf and node.kind is ATTN:
            node.fields["obf"] = 1
    ints = p.int_arena()
    table = [int(b) for b in np.random.RandomState(0).permutation(128 // bs)]
    words_ = step_words(dec, [(pos, table)])
    r = p.int_regions["step"]
    ints[r.offset:r.offset + len(words_)] = torch.tensor(words_, dtype=torch.int32)
    ints[p.int_regions["token"].offset] = 5
    kv = torch.randn(p.kv.shape, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    for t in range(pos, 128):              # past the context: NaN, which must not reach an output
        kv[:, :, table[t // bs], t % bs] = float("nan")
    start = p.arena()
    kv_want = kv.clone()
    want = reference(p, start, ints.clone(), kv_want, steps=steps)
    body = emulated(attention.attn, waits=lambda *a: a[7], barrier=lambda: None)
    arena, ints_e = start.clone(), ints.clone()
    cache = kv.float().numpy().copy()
    counters = np.zeros(max(1, len(p.tickets)), np.int64)
    kvt = config.kv_tokens
    for s in range(steps):
        for node in p.nodes:
            f = node.fields
            if node.kind is not ATTN:
                kv_t = torch.from_numpy(cache).to(torch.bfloat16)
                run_node(p, arena, node, ints_e, kv_t, s)
                cache[...] = kv_t.float().numpy()
                continue
            n_ctx = pos + 1 + s
            share = cdiv(cdiv(n_ctx, f["splits"]), kvt) * kvt      # the kernel's shares: whole chunks
            lo = min(f["split"] * share, n_ctx)
            hi = min(lo + share, n_ctx)
            ring = kv_chunks(f, cache, ints_e.numpy(), config, lo, hi, pos)
            none = S(np.zeros((len(ring), 1)))
            xs = S(np.zeros((config.x_rows, config.block_k), np.float32))
            c = config.constexprs()
            it, failed = body(P(arena.numpy()), P(ints_e.numpy().astype(np.int64)), P(cache.reshape(-1)),
                              words(ATTN, f), S(ring), none, none, xs, 0, P(counters), None, 0, s, 0, 0, 0, None,
                              -1, 0, -1, 0, len(ring), SPIN, False, kernel.CW.value, c["HD"], c["GP"], c["TILE"],
                              kvt, obf, bool(aw))
            assert int(it) == cdiv(hi - lo, kvt) * (2 if config.kv_split else 1) and failed == 0
    assert torch.isfinite(arena[torch.isfinite(want)]).all(), "a NaN from past the context reached an output"
    fin = torch.isfinite(want)
    # a later step's k, rounded to bf16 after fp32 math in another order, can flip an ulp
    torch.testing.assert_close(arena[fin], want[fin], rtol=2e-3, atol=2e-3)
    done = torch.isfinite(kv_want.float())
    torch.testing.assert_close(torch.from_numpy(cache)[done], kv_want.float()[done], rtol=1e-2, atol=1e-2)
    assert counters.sum() == 0              # every merge set its ticket back


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
@pytest.mark.parametrize("parts", [0, 3, 6])
@pytest.mark.parametrize("norm, sk", [(True, True), (False, True), (True, False)])
def test_cast_body_writes_the_references_bf16_row(norm, sk, parts, k, hd):
    """CAST (a batched kernel's): a row of k floats (with parts, plus that many split-K partials,
    added in split order and written back to the row), RMS-normalised with its weights or not, as
    bf16 in the arena's words from `out` (two a word, the low half first), the reference's bits
    exactly; nothing past the row's k / 2 words. A row wider than the body's block (2,048 values,
    1,024 in a kernel of head size hd 128) is summed block by block, then normalised in a second pass. sk: the merge
    compiled in (a 16-row kernel has none: no partials)."""
    if parts and not sk:
        pytest.skip("a kernel without split-K tiles has no partials to add")
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
