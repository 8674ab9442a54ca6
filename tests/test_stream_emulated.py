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
