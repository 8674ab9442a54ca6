"""The program of a StreamDecoder's step (llm/stream_step.py), recorded once per split level: every
layer's qkv, attention, o_proj, gate/up and down, then lm_head and the sampling, with the regions
they read and write; with tensor parallelism, the all-reduce nodes between them.

    program = record_step(dec, weights, packed, embed, rope, splits)
"""
from __future__ import annotations

from warploop.llm.kv_cache import cdiv
from warploop.llm.stream_pools import Packed
from warploop.llm.weights import ModelWeights
from warploop.runtime.stream.arena import Region
from warploop.runtime.stream.compiled import StreamConfig
from warploop.runtime.stream.kinds import MAX_CAST_PARTS, SAMP_WORDS
from warploop.runtime.stream.program import StreamProgram

# a split-K tile's fewest chunks (BK columns each): its x block copies and its stores are per tile
KSPLIT_CHUNKS = 4


def narrow(rows: int, config: StreamConfig, ctas: int = 132) -> bool:
    """Whether a stage of `rows` output rows runs as narrow tiles (BR/2 rows): when even its narrow
    tiles do not outnumber the SMs, so halving the tiles' rows halves the stage's time."""
    return 2 * -(-rows // config.block_rows) <= ctas


def tall(rows: int, config: StreamConfig, ctas: int = 132, silu: bool = False) -> bool:
    """Whether a stage of `rows` output rows runs as tall tiles (kinds.GEMV tall, StreamConfig.gemv_tall):
    when its plain tiles (BR rows, BR/2 outputs of silu_mul) outnumber the SMs, so two of them
    share one stream of x."""
    return config.gemv_tall and -(-rows // (config.block_rows // (2 if silu else 1))) > ctas


def k_splits(rows: int, k: int, config: StreamConfig, ctas: int = 132) -> int:
    """Into how many runs of its k columns a batched kernel's stage of `rows` output rows splits
    (program.gemv's splits; 1: none): the most, up to MAX_CAST_PARTS, whose tiles do not outnumber the SMs, each
    at least KSPLIT_CHUNKS chunks, in a kernel of 64-row tiles (wgmma: 32 batch rows). A split tile
    holds BR rows against BK-column blocks of x, where a narrow one holds BR/2 against two blocks: the
    same SMs, half the copies of x a weight byte."""
    if config.block_rows != 64:          # measured faster on wgmma's tiles only (BENCHMARKS.md)
        return 1
    tiles, bk, best = cdiv(rows, config.block_rows), config.block_k, 1
    for s in range(2, MAX_CAST_PARTS + 1):
        width = cdiv(cdiv(k, s), bk) * bk
        if width >= KSPLIT_CHUNKS * bk and tiles * cdiv(k, width) <= ctas:
            best = max(best, cdiv(k, width))
    return best


def record_step(dec, weights: ModelWeights, packed: Packed, embed, rope, splits: int) -> StreamProgram:
    """The step's program of `dec` (a StreamDecoder: its model, kernel shape, rows, KV cache and
    tensor-parallel rank) with `splits` attention shares per KV head (every level's program
    declares the same regions: the partials' region holds the largest level's)."""
    import torch
    cfg, max_context, rows = dec.cfg, dec.max_context, dec.batch
    p = StreamProgram(dec.config)
    f32 = lambda t: t.detach().to(device=dec.device, dtype=torch.float32)
    index = {k: p.pool(pool) for k, pool in packed.pools.items()}
    at = [(index[k], row) for k, row in packed.at]
    hd, kvh, h = cfg.head_dim, cfg.num_kv_heads, cfg.num_heads
    p.kv_cache(dec.kv)
    world = dec.world
    vocab = cfg.vocab_size if world == 1 else weights.lm_head.shape[0]     # this rank's logits
    head_tall = world == 1 and tall(vocab, dec.config)
    per = cdiv(vocab, dec.config.block_rows * (2 if head_tall else 1))   # the lm_head tiles' amax pairs
    width = {"res": cfg.hidden_size, "qkv": cfg.q_size + 2 * cfg.kv_size, "attn": cfg.q_size,
             "act": cfg.intermediate_size, "logits": vocab, "pairs": 2 * per * world, "step": dec.step_words,
             "token": 1, "tokens": dec.MAX_STEPS, "part": kvh * dec.splits * (h // kvh) * (hd + 2)}
    xbf = bool(dec.config.batch_rows)   # a batched kernel's GEMVs read bf16 rows (gemv_rows.py)
    if xbf and world > 1:
        raise ValueError("a tensor-parallel rank decodes one row, and this kernel is batched (StreamConfig.batch_rows)")
    # batched, attention and gate/up write o_proj's and down's inputs as bf16 rows only (xb_attn, xb_act)
    r = {name: p.buffer(name, rows * width[name]) for name in ("res", "qkv", "attn", "act", "logits")
         if not (xbf and name in ("attn", "act"))}
    if world > 1:             # each rank's partial sums, one region an all-reduce a layer (two
        # regions, so a rank overwrites one only after a later all-reduce, whose signals the
        # peers send once they are done reading it: on a GPU they read it in place); the
        # embedding row (the token's rank's, zeros elsewhere) and the ranks' gathered amax pairs
        r |= {name: p.buffer(name, rows * cfg.hidden_size) for name in ("red_attn", "red_mlp", "red_emb")}
        r["pairs_all"] = p.buffer("pairs_all", width["pairs"])
    cos, sin = rope
    r["cos"], r["sin"] = p.buffer("cos", cos.numel(), init=cos), p.buffer("sin", sin.numel(), init=sin)
    r |= {name: p.ints(name, rows * width[name]) for name in ("step", "token", "tokens")}
    if rows == 1:             # the row's sampling words (kinds.SAMP_WORDS): the host writes the first
        # four a launch; the last is the token id of this rank's first logit less their offset
        first = 0 if world == 1 else dec.tp.rank * vocab
        r["samp"] = p.ints("samp", len(SAMP_WORDS), init=[0] * (len(SAMP_WORDS) - 1) + [first - r["logits"].offset])
    if world == 1:
        r["pairs"] = p.buffer("pairs", rows * width["pairs"])
    else:                     # this rank's tiles fill its run of pairs; a run's pairs past the tiles
        # hold -inf (the last shard's fewer rows), other ranks' runs zeros: the all-reduce's sum is
        # then every rank's pairs, exactly
        rank, tiles = dec.tp.rank, cdiv(min(vocab, cfg.vocab_size - dec.tp.rank * vocab), dec.config.block_rows)
        init = torch.zeros(width["pairs"])
        init[2 * (rank * per + tiles):2 * (rank + 1) * per:2] = float("-inf")
        r["pairs"] = p.buffer("pairs", width["pairs"], init=init)
    p.embedding(embed)
    if dec.splits > 1:
        r["part"] = p.buffer("part", rows * width["part"])
    # batched, o_proj and down split K where their tiles are fewer than the SMs: each split's partial
    # sums go to kpart and the CAST nodes after them add them into the residual
    ksplit = {"o": k_splits(cfg.hidden_size, cfg.q_size, dec.config) if world == 1 else 1,
              "down": k_splits(cfg.hidden_size, cfg.intermediate_size, dec.config) if world == 1 else 1}
    if max(ksplit.values()) > 1:
        r["kpart"] = p.buffer("kpart", max(ksplit.values()) * rows * cfg.hidden_size)
    row = lambda name, b: Region(r[name].offset + b * width[name], width[name])    # row b's slice
    vec = lambda name, t: None if t is None else p.buffer(name, t.numel(), init=f32(t))
    eps = cfg.rms_norm_eps
    if xbf:                   # the GEMVs' inputs as bf16 rows: xb_res made by CAST nodes, xb_attn by
        # attention and xb_act by gate/up (ATTN and GEMV obf)
        r |= {f"xb_{name}": p.buffer(f"xb_{name}", rows * width[name] // 2) for name in ("res", "attn", "act")}

    def xrow(name: str, b: int) -> Region:
        """Row b's slice of the bf16 rows xb_NAME (half a float a value)."""
        return Region(r[f"xb_{name}"].offset + b * width[name] // 2, width[name] // 2)

    def res_in(norm, after, parts: int = 1):
        """(x, norm, deps) for a GEMV that reads the residual through `norm`: batched, CAST nodes'
        normalised bf16 copy of its rows, after them (which add `parts` split-K partials into it)."""
        if not xbf:
            return r["res"], norm, after
        return r["xb_res"], None, p.cast(r["res"], r["xb_res"], width["res"], rows, norm=norm, eps=eps, after=after,
                                         part=r["kpart"] if parts > 1 else None, parts=parts if parts > 1 else 0)

    def residual_gemv(pool: int, first: int, k: int, x: Region, out: Region, bias, after, parts: int):
        """o_proj or down into the residual (with tensor parallelism, this rank's partial sums): its
        rows added into out, or split K into kpart's `parts` partials."""
        if parts > 1:
            return p.gemv(pool, first, cfg.hidden_size, x, r["kpart"], batch=rows, after=after, xbf=xbf, splits=parts)
        return p.gemv(pool, first, cfg.hidden_size, x, out, epi="add" if world == 1 else "store", bias=bias,
                      narrow=narrow(cfg.hidden_size, dec.config), batch=rows, after=after, xbf=xbf)
    if world == 1:
        firsts = [p.embed(row("token", b), row("res", b), cfg.hidden_size) for b in range(rows)]
        prev: list[int] = firsts
    else:                     # the token's rank has its row, the others zeros: their sum is the row
        firsts = [p.embed(row("token", 0), r["red_emb"], cfg.hidden_size, first=dec.tp.rank * vocab)]
        prev = p.allreduce(r["red_emb"], r["res"], cfg.hidden_size, world=world, rank=dec.tp.rank, after=firsts)
    prev_parts = 1            # the split-K partials the residual's next CAST adds (the embedding rows: none)
    for i, lw in enumerate(weights.layers):
        (qkv_pool, qkv_row), (o_pool, o_row), (gu_pool, gu_row), (d_pool, d_row) = at[4 * i:4 * i + 4]
        x, norm, after = res_in(vec(f"in{i}", lw.input_norm), prev, prev_parts)
        a = p.gemv(qkv_pool, qkv_row, cfg.q_size + 2 * cfg.kv_size, x, r["qkv"], eps=eps,
                   narrow=narrow(cfg.q_size + 2 * cfg.kv_size, dec.config), batch=rows,
                   norm=norm, bias=vec(f"bqkv{i}", lw.qkv_bias), after=after, xbf=xbf)
        qn, kn = vec(f"qn{i}", lw.q_norm), vec(f"kn{i}", lw.k_norm)
        # batched, attention writes bf16 rows that o_proj reads as they are (obf: no CAST between them)
        a = [p.attention(row("qkv", b), xrow("attn", b) if xbf else row("attn", b), row("step", b), r["cos"], r["sin"],
                         heads=h, kv_heads=kvh, layer=i, scale=hd ** -0.5, qn=qn, kn=kn, eps=eps, ctx=max_context,
                         splits=splits, part=row("part", b) if splits > 1 else None, after=a, obf=xbf)
             for b in range(rows)]
        # with tensor parallelism, o_proj and down_proj store this rank's partial sums and
        # all-reduce nodes add every rank's into the residual
        o_parts = 1 if lw.o_bias is not None else ksplit["o"]     # a bias is added once: no split
        b = residual_gemv(o_pool, o_row, cfg.q_size, r["xb_attn" if xbf else "attn"],
                          r["res"] if world == 1 else r["red_attn"], vec(f"bo{i}", lw.o_bias), a, o_parts)
        if world > 1:
            b = p.allreduce(r["red_attn"], r["res"], rows * cfg.hidden_size, world=world, rank=dec.tp.rank,
                            epi="add", after=b)
        x, norm, after = res_in(vec(f"post{i}", lw.post_norm), b, o_parts)
        # batched, gate/up writes bf16 rows that down reads as they are (obf: no CAST between them)
        act = r["xb_act" if xbf else "act"]
        c = p.gemv(gu_pool, gu_row, cfg.intermediate_size, x, act, norm=norm, eps=eps, epi="silu_mul",
                   up=gu_row + cfg.intermediate_size, batch=rows, after=after, xbf=xbf, obf=xbf,
                   tall=tall(cfg.intermediate_size, dec.config, silu=True))
        prev = residual_gemv(d_pool, d_row, cfg.intermediate_size, act, r["res"] if world == 1 else r["red_mlp"],
                             None, c, ksplit["down"])
        prev_parts = ksplit["down"]
        if world > 1:
            prev = p.allreduce(r["red_mlp"], r["res"], rows * cfg.hidden_size, world=world, rank=dec.tp.rank,
                               epi="add", after=prev)
    if world == 1:
        x, norm, after = res_in(vec("final", weights.norm), prev, prev_parts)
        head = p.gemv(*at[-1], cfg.vocab_size, x, r["logits"], norm=norm, eps=eps, amax=r["pairs"], batch=rows,
                      after=after, samp=r.get("samp"), xbf=xbf, tall=head_tall)
        samples = [p.sample(row("pairs", b), len(head), row("logits", b), row("token", b), row("tokens", b),
                            after=head) for b in range(rows)]
    else:                     # this rank's shard of the vocabulary (the last shard's real rows), its
        # pairs gathered from every rank, then every rank samples the same token
        rank = dec.tp.rank
        real = min(vocab, cfg.vocab_size - rank * vocab)
        mine = Region(r["pairs"].offset + 2 * rank * per, 2 * per)
        head = p.gemv(*at[-1], real, r["res"], r["logits"], norm=vec("final", weights.norm), eps=eps,
                      amax=mine, after=prev, samp=r["samp"])
        gathered = p.allreduce(r["pairs"], r["pairs_all"], width["pairs"], world=world, rank=rank, after=head)
        samples = [p.sample(r["pairs_all"], world * per, r["logits"], row("token", 0), row("tokens", 0),
                            after=gathered, per=per, shard=vocab)]
    p.decode_loop(samples, firsts)
    return p
