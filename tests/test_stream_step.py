"""A model's decode step on the streaming executor (warploop/llm/stream_step.py) against the
engine's per-op backend: the same greedy tokens and logits within bf16 KV rounding, for Llama,
Qwen2 (biases) and Qwen3 (q/k norm) configs. On the CPU the program runs on the CPU reference; on a
Hopper GPU on the streaming kernel (tests/test_stream_gpu.py runs this file's check there)."""
import dataclasses

import pytest
import torch

from warploop.llm.backend import ModelBatch
from warploop.llm.build import build_backend
from warploop.llm.config import ModelConfig
from warploop.llm.rope import RopeConfig
from warploop.llm.stream_step import StreamDecoder, attention_splits, batch_rows, split_levels, stream_config
from warploop.llm.weights import random_weights

CONFIGS = {
    "llama3": ModelConfig(family="llama", vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=2,
                          num_heads=4, num_kv_heads=2, head_dim=16, tie_word_embeddings=False,
                          rope=RopeConfig("llama3", 500000.0, 8.0, original_max_position_embeddings=64)),
    "qwen2_bias": ModelConfig(family="qwen2", vocab_size=80, hidden_size=64, intermediate_size=80, num_layers=2,
                              num_heads=4, num_kv_heads=1, head_dim=16, qkv_bias=True),
    "qwen3_qk_norm": ModelConfig(family="qwen3", vocab_size=72, hidden_size=64, intermediate_size=64, num_layers=2,
                                 num_heads=8, num_kv_heads=2, head_dim=16, qk_norm=True, o_bias=True),
}


def bf16_exact_weights(cfg, device="cpu", seed=0):
    """Random fp32 weights that bf16 holds exactly (both paths then read the same numbers), with
    norms and biases that are not all ones and zeros."""
    w = random_weights(cfg, device, torch.float32, seed)
    g = torch.Generator(device=device).manual_seed(seed + 1)
    tensors = [w.embed, w.lm_head, w.norm] + [t for lw in w.layers for t in vars(lw).values() if t is not None]
    for t in tensors:
        if t.dim() == 1:
            t.add_(0.2 * torch.randn(t.shape, generator=g, device=device))
        else:
            t.mul_(3.0)                  # wider logits: greedy picks with clear margins
        t.copy_(t.to(torch.bfloat16).float())
    return w


def greedy(cfg, device, steps=10, **decoder_options):
    """The per-op backend's greedy tokens after a prompt; the decoder's, one step a run (the host
    picking from the logits), and its own decode loop's (`generate`: one launch, the GPU picking);
    the largest relative logits error of the step-by-step run."""
    w = bf16_exact_weights(cfg, device)
    backend, _ = build_backend(cfg, w, torch.device(device), block_size=4, num_kv_blocks=16, use_cuda_graphs=False)
    prompt = [3, 17, 5, 60, 2, 41]
    table = list(range(8))
    n = len(prompt)
    ref_logits = [backend.forward(ModelBatch(prompt, list(range(n)), [n], [n], [table]))[-1]]
    ref_tokens = [int(ref_logits[-1].argmax())]
    for pos in range(n, n + steps - 1):
        ref_logits.append(backend.forward(ModelBatch([ref_tokens[-1]], [pos], [1], [pos + 1], [table]))[-1])
        ref_tokens.append(int(ref_logits[-1].argmax()))
    dec = StreamDecoder(cfg, w, device=device, max_context=32, block_size=4, **decoder_options)
    for pos, tok in enumerate(prompt[:-1]):
        dec.step(tok, pos)
    tokens, errs = [], []
    tok = prompt[-1]
    for pos in range(n - 1, n - 1 + steps):
        logits = dec.step(tok, pos).float()
        ref = ref_logits[pos - n + 1].float().to(logits.device)
        errs.append(((logits - ref).norm() / ref.norm()).item())
        tok = int(logits.argmax())
        tokens.append(tok)
    loop = StreamDecoder(cfg, w, device=device, max_context=32, block_size=4, **decoder_options)
    for pos, tok in enumerate(prompt[:-1]):
        loop.step(tok, pos)
    looped = loop.generate(prompt[-1], n - 1, steps)
    return tokens, ref_tokens, max(errs), looped


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("splits", [1, 3])
def test_stream_step_greedy_tokens_equal_per_op_backend(name, splits):
    tokens, ref_tokens, err, looped = greedy(CONFIGS[name], "cpu", splits=splits, config=stream_config(CONFIGS[name]))
    assert tokens == ref_tokens
    assert looped == ref_tokens             # the decode loop: embedding, sampling and steps in one run
    assert err < 2e-2, f"logits differ by {err:.3g} (bf16 KV cache against the per-op backend's fp32)"


def test_stream_step_refuses_what_it_cannot_run():
    cfg = CONFIGS["llama3"]
    w = bf16_exact_weights(cfg)
    dec = StreamDecoder(cfg, w, max_context=16, block_size=4)
    with pytest.raises(ValueError, match="max_context"):
        dec.step(1, 16)
    with pytest.raises(ValueError, match="vocabulary"):
        dec.step(cfg.vocab_size, 0)
    with pytest.raises(ValueError, match="block table"):
        dec.step(1, 9, table=[0, 1])
    with pytest.raises(ValueError, match="block table"):
        dec.generate(1, 5, 4, table=[0, 1])            # positions 5-8 need 3 blocks
    with pytest.raises(ValueError, match="max_context"):
        dec.generate(1, 10, 8)
    with pytest.raises(ValueError, match="steps"):
        dec.generate(1, 0, 0)
    import dataclasses
    with pytest.raises(NotImplementedError, match="MLP bias"):
        StreamDecoder(dataclasses.replace(cfg, mlp_bias=True), w)


def levels_against_one_program(device, steps=70, defer=False):
    """A decoder with its split levels (max_context 128, ring chunks of 32 tokens: programs with 1,
    2 and 4 shares a KV head) against one that always runs 4: each step's logits over contexts
    1 to `steps` (crossing both level boundaries), then a decode loop that starts in one level and
    ends in the next. Returns (levels, the largest relative logits error, looped, one's loop).
    defer: the decoder builds levels 2 and 4 when a step first needs them (StreamDecoder defer=True)."""
    cfg = CONFIGS["qwen3_qk_norm"]
    config = stream_config(cfg, block_rows=16, block_k=64)          # 16 x 64 bf16 / (2 x 16) = 32 tokens
    w = bf16_exact_weights(cfg, device)
    opts = dict(device=device, max_context=128, block_size=4, config=config)
    many, one = StreamDecoder(cfg, w, defer=defer, **opts), StreamDecoder(cfg, w, splits=4, **opts)
    assert sorted(many.programs) == ([1] if defer else [1, 2, 4])
    errs, tok = [], 3
    for pos in range(steps):
        a, b = many.step(tok, pos).float(), one.step(tok, pos).float()
        errs.append(((a - b).norm() / b.norm()).item())
        tok = int(b.argmax())
    # positions 20 to 49: level 2 (at most 64 tokens) picked for the whole launch
    assert sorted(many.programs) == [1, 2, 4] and not many.build_deferred()
    if device == "cuda":
        assert sorted(many.executors) == [1, 2, 4]
    return many.levels, max(errs), many.generate(tok, 20, 30), one.generate(tok, 20, 30)


def test_split_levels_and_the_level_a_context_runs():
    cfg = CONFIGS["qwen3_qk_norm"]
    config = stream_config(cfg, block_rows=16, block_k=64)
    assert config.kv_tokens == 32
    assert split_levels(cfg, config, 128) == [1, 2, 4]
    assert split_levels(cfg, config, 32) == [1]
    big = stream_config(cfg)
    top = attention_splits(cfg, big, 100_000)
    assert top == (132 - 2) // 2 and split_levels(cfg, big, 100_000) == [1, 2, 4, 8, 16, 32, 64, top]
    # a batch's rows each take their KV heads' attention nodes: fewer shares a row, on every SM
    assert attention_splits(cfg, big, 100_000, rows=8) == 132 // 16
    assert attention_splits(cfg, big, 100_000, rows=32) == 132 // 64
    assert split_levels(cfg, big, 100_000, rows=32) == [1, 2] and attention_splits(cfg, big, 10, rows=70) == 1
    w = bf16_exact_weights(cfg)
    dec = StreamDecoder(cfg, w, max_context=128, block_size=4, config=config)
    assert dec.splits == 4 and list(dec.programs) == [1, 2, 4]
    assert [dec.level(n) for n in (1, 32, 33, 64, 65, 128)] == [1, 1, 2, 2, 4, 4]
    assert all(p.regions == dec.program.regions for p in dec.programs.values())
    from warploop.runtime.stream.hazards import check_hazards
    for p in dec.programs.values():             # on the GPU only the largest level is checked
        check_hazards(p)
    assert StreamDecoder(cfg, w, max_context=128, block_size=4, config=config, splits=3).levels == [3]


def test_a_deferred_level_is_built_in_two_idle_slices_or_at_once_when_needed():
    """build_deferred records a level's program in one call and builds the rest in the next, so a
    request waits for half a level at most; a launch that needs a level only recorded finishes it."""
    cfg = CONFIGS["qwen3_qk_norm"]
    config = stream_config(cfg, block_rows=16, block_k=64)
    dec = StreamDecoder(cfg, bf16_exact_weights(cfg), max_context=128, block_size=4, config=config, defer=True)
    assert dec._deferred == [2, 4] and sorted(dec.programs) == [1]
    assert dec.build_deferred() and dec._deferred == [2, 4] and sorted(dec.programs) == [1, 2]    # recorded
    assert dec.build_deferred() and dec._deferred == [4]                                          # built
    assert dec.build_deferred() and sorted(dec.programs) == [1, 2, 4]
    dec._build_level(4)                 # a launch's need: the recorded level 4 is finished, not recorded again
    assert dec._deferred == [] and not dec.build_deferred()


@pytest.mark.parametrize("defer", [False, True])
def test_stream_step_levels_give_the_one_program_logits(defer):
    levels, err, looped, ref = levels_against_one_program("cpu", defer=defer)
    assert levels == [1, 2, 4]
    assert err < 1e-5, f"logits differ by {err:.3g} between a decoder's split levels and one program"
    assert looped == ref


def assert_like_per_op(want, got, looped, stepped) -> torch.Tensor:
    """batch_against_per_op's results: the decoder's logits within 2e-2 of the per-op backend's
    (relative, bf16 KV), its greedy picks equal wherever they are not a near tie (the cache's bf16
    rounding may flip one), and its own loop's tokens its steps'. Returns the clear picks' mask."""
    err = ((got - want).norm(dim=-1) / want.norm(dim=-1)).max().item()
    assert err < 2e-2, f"logits differ by {err:.3g} (bf16 KV cache against the per-op backend's fp32)"
    top2 = want.topk(2, dim=-1).values
    clear = (top2[..., 0] - top2[..., 1]) > 1e-2 * want.abs().amax(-1)
    assert (got.argmax(-1) == want.argmax(-1))[clear].all()
    assert looped == stepped
    return clear


def batch_against_per_op(cfg, batch: int, steps: int = 6, device="cpu", context: int = 0, block_size: int = 4,
                         **decoder_options):
    """Rows with prompts of different lengths (mixed contexts), each its own blocks, decoded by the
    per-op backend (greedy, the whole batch a step at a time) and by a batched decoder fed the same
    tokens (step_rows), over the cache the per-op prefill wrote (rounded to the decoder's bf16); then
    a second batched decoder's own greedy loop in one launch (generate_rows) and the first one's
    own greedy steps. Returns (per-op logits, decoder logits: [steps, batch, vocab] each, looped
    tokens, stepped tokens). context: tokens added to every prompt (contexts of several ring chunks)."""
    w = bf16_exact_weights(cfg, device)
    per_row = (64 + context) // block_size                # blocks a row: 64 tokens and the context
    lengths = [context + 3 + (5 * b) % 23 for b in range(batch)]
    prompts = [[(7 * b + 3 * i) % cfg.vocab_size for i in range(n)] for b, n in enumerate(lengths)]
    tables = [list(range(b * per_row, (b + 1) * per_row)) for b in range(batch)]

    def prefilled():
        backend, _ = build_backend(cfg, w, torch.device(device), block_size=block_size, num_kv_blocks=batch * per_row,
                                   use_cuda_graphs=False)
        firsts = []
        for prompt, table in zip(prompts, tables, strict=True):
            n = len(prompt)
            firsts.append(int(backend.forward(ModelBatch(prompt, list(range(n)), [n], [n], [table]))[-1].argmax()))
        return backend, firsts

    def decoder():
        backend, firsts = prefilled()
        return StreamDecoder(cfg, w, device=device, max_context=per_row * block_size, block_size=block_size,
                             kv=backend.kv.to(torch.bfloat16), batch=batch, **decoder_options), firsts

    ref, firsts = prefilled()
    dec, _ = decoder()
    toks, pos, want, got = list(firsts), list(lengths), [], []
    for _ in range(steps):
        want.append(ref.forward(ModelBatch(toks, pos, [1] * batch, [p + 1 for p in pos], tables)).float())
        got.append(dec.step_rows(toks, pos, tables).float().clone())
        toks, pos = [int(t) for t in want[-1].argmax(-1)], [p + 1 for p in pos]
    loop, firsts = decoder()
    looped = loop.generate_rows(firsts, lengths, steps, tables)
    own, _ = decoder()
    toks, pos, stepped = list(firsts), list(lengths), []
    for _ in range(steps):
        toks, pos = [int(t) for t in own.step_rows(toks, pos, tables).argmax(-1)], [p + 1 for p in pos]
        stepped.append(toks)
    return torch.stack(want), torch.stack(got), looped, [list(r) for r in zip(*stepped, strict=True)]


@pytest.mark.parametrize("batch", [1, 2, 8, 32, 64])
def test_batched_decoder_gives_the_per_op_backends_tokens(batch):
    """Batches on the streaming program (CPU reference), every row its own position and blocks:
    the per-op backend's logits within bf16 KV rounding and its greedy picks wherever they are not
    a near tie (the cache's bf16 rounding may flip one), every step; its own greedy loop in one
    launch equals its greedy steps. Batched, every GEMV reads CAST nodes' normalised bf16 rows."""
    cfg = CONFIGS["qwen3_qk_norm"]
    config = stream_config(cfg, batch_rows=batch_rows(batch))
    want, got, looped, stepped = batch_against_per_op(cfg, batch, config=config)
    clear = assert_like_per_op(want, got, looped, stepped)
    assert clear.float().mean() > 0.8                                   # the check has picks to check
    assert batch == 1 or len({tuple(r) for r in stepped}) > 1         # the rows differ


@pytest.mark.parametrize("batch", [2, 17])
def test_tall_tile_decoder_gives_the_per_op_backends_tokens(batch, monkeypatch):
    """StreamConfig.gemv_tall: gate/up and the lm_head as tall tiles (two ring slots a chunk, forced here
    for these small shapes; stream_record.tall picks them where plain tiles outnumber the SMs); the
    per-op backend's logits and picks, and loops equal to steps."""
    from warploop.llm import stream_record
    monkeypatch.setattr(stream_record, "tall", lambda rows, config, ctas=132, silu=False: config.gemv_tall)
    config = stream_config(HD64, batch_rows=batch_rows(batch), block_k=128, block_rows=64, gemv_tall=True)
    want, got, looped, stepped = batch_against_per_op(HD64, batch, steps=4, config=config)
    assert_like_per_op(want, got, looped, stepped)
    assert stream_config(HD64, batch_rows=32).gemv_tall is False      # an option, off by default


def test_tall_tiles_take_the_stages_whose_tiles_outnumber_the_sms():
    from warploop.llm import stream_record
    config = stream_config(HD64, batch_rows=32, gemv_tall=True)
    assert stream_record.tall(128256, config)                             # an lm_head: 2,004 tiles
    assert stream_record.tall(8192, config, silu=True)                    # gate/up: 256 tiles of 32 outputs
    assert not stream_record.tall(2048, config) and not stream_record.tall(8192, config)   # 32 and 128 tiles
    assert not stream_record.tall(128256, stream_config(HD64, batch_rows=32))             # the option off


@pytest.mark.parametrize("batch", [2, 8])
def test_split_k_decoder_gives_the_per_op_backends_tokens(batch, monkeypatch):
    """o_proj and down split K (stream_record.k_splits, forced down to one chunk a split here): each
    split's tiles store partial sums and the CAST nodes after them add them into the residual, in
    split order; the per-op backend's logits and picks, and loops equal to steps."""
    from warploop.llm import stream_record
    monkeypatch.setattr(stream_record, "KSPLIT_CHUNKS", 1)
    cfg = HD64
    config = stream_config(cfg, batch_rows=batch_rows(batch), block_k=128, block_rows=64)
    assert stream_record.k_splits(cfg.hidden_size, cfg.intermediate_size, config) == 1     # 128 columns: one chunk
    cfg = dataclasses.replace(HD64, intermediate_size=512)
    assert stream_record.k_splits(cfg.hidden_size, cfg.intermediate_size, config) == 4
    want, got, looped, stepped = batch_against_per_op(cfg, batch, steps=4, config=config)
    assert_like_per_op(want, got, looped, stepped)
    dec = StreamDecoder(cfg, bf16_exact_weights(cfg), max_context=32, block_size=4, batch=batch, config=config)
    split = [n for n in dec.program.nodes if n.kind.name == "gemv" and n.fields["k"] < n.fields["xk"]]
    merges = [n for n in dec.program.nodes if n.kind.name == "cast" and n.fields["parts"] == 4]
    # o_proj and down (512 columns each), 2 tiles of 64 rows, 4 splits, 2 layers
    assert len(split) == 2 * 4 * 2 * 2 and {n.fields["col"] for n in split} == {0, 128, 256, 384}
    assert len(merges) == 2 * 2 * batch   # the CASTs after each o_proj and each down, a node a row


# head_dim 64: attention on wgmma (StreamConfig.attn_wgmma) is for it
HD64 = ModelConfig(family="qwen3", vocab_size=72, hidden_size=128, intermediate_size=128, num_layers=2, num_heads=8,
                   num_kv_heads=2, head_dim=64, qk_norm=True)
HD128 = ModelConfig(family="qwen3", vocab_size=72, hidden_size=128, intermediate_size=128, num_layers=2, num_heads=8,
                    num_kv_heads=4, head_dim=128, qk_norm=True)
WGMMA_MODELS = {"hd64": HD64, "hd128": HD128}


@pytest.mark.parametrize("model", [*WGMMA_MODELS, "hd64_kv_split"])
def test_batched_decoder_with_wgmma_attention_gives_the_per_op_backends_tokens(model):
    """attn_wgmma's model on the CPU reference (q and each ring chunk's probabilities rounded to
    bf16, the softmax online a chunk at a time, as the kernel) against the per-op backend, over
    contexts of several chunks (hd64_kv_split: StreamConfig.attn_kv_split, 128-token chunks, over 300)."""
    split = model.endswith("_kv_split")
    cfg = WGMMA_MODELS[model.removesuffix("_kv_split")]
    config = stream_config(cfg, batch_rows=batch_rows(4), attn_wgmma=True, attn_kv_split=split)
    assert config.kv_tokens == (128 if split else 64)
    want, got, looped, stepped = batch_against_per_op(cfg, 4, steps=3, config=config, context=300 if split else 100,
                                                      block_size=16)
    assert_like_per_op(want, got, looped, stepped)


def test_wgmma_attention_refuses_kv_blocks_under_8_tokens():
    config = stream_config(HD64, batch_rows=16, attn_wgmma=True)
    assert config.kv_box(16) == 16
    with pytest.raises(ValueError, match="attn_wgmma needs KV blocks of at least 8 tokens"):
        config.kv_box(4)
    with pytest.raises(ValueError, match="attn_wgmma needs batch_rows"):
        stream_config(HD64, attn_wgmma=True)
    with pytest.raises(ValueError, match="attn_kv_split needs attn_wgmma at head_dim 64"):
        stream_config(HD128, batch_rows=32, attn_wgmma=True, attn_kv_split=True)
    with pytest.raises(ValueError, match="attn_kv_split needs attn_wgmma"):
        stream_config(HD64, batch_rows=16, attn_wgmma=False, attn_kv_split=True)


def test_batched_decoder_runs_fewer_live_rows_than_it_holds():
    """A decoder of 8 rows given 3 (the rest idle: no context, no KV write) gives a 3-row decoder's
    logits and loop tokens for them, and leaves the same cache: one decoder serves every batch up to
    its rows."""
    cfg = CONFIGS["qwen3_qk_norm"]
    w = bf16_exact_weights(cfg)
    kv0 = torch.randn(cfg.num_layers, 2, 24, 4, cfg.num_kv_heads, cfg.head_dim,
                      generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    tables = [[4, 5, 6, 7], [8, 9, 10, 11], [16, 17, 18, 19]]     # block 0 is the idle rows' table
    tokens, positions = [5, 9, 11], [6, 2, 9]
    out = {}
    for rows in (3, 8):
        dec = StreamDecoder(cfg, w, max_context=16, block_size=4, batch=rows, kv=kv0.clone())
        logits = dec.step_rows(tokens, positions, tables)[:3].clone()
        looped = dec.generate_rows(tokens, [p + 1 for p in positions], 4, tables)[:3]
        out[rows] = logits, looped, dec.kv.clone()
    torch.testing.assert_close(out[8][0], out[3][0], rtol=1e-5, atol=1e-5)
    assert out[8][1] == out[3][1]
    assert torch.equal(out[8][2][:, :, 0], kv0[:, :, 0])       # the idle rows wrote nothing
    # the live rows' writes: the same but for a bf16 ulp where a loop step's k rounds the other way
    torch.testing.assert_close(out[8][2].float(), out[3][2].float(), rtol=0, atol=2e-2)
    assert torch.isfinite(out[8][0]).all()


def test_a_batched_kernel_of_32_rows_multiplies_tiles_of_64_rows_on_wgmma():
    """stream_config's BATCH_SHAPES: at 32 rows, tiles of 64 weight rows by 128 inputs (the wgmma
    tiles), 8 ring slots and 64 KB of x (4 stages of 128 inputs, sized as fp32) for every bench shape, within
    shared memory; at 64 rows the same tiles and 4 stages in 64 KB of bf16; 16 rows keep the ring's and
    the tiles' defaults; every batched kernel reads bf16 rows, a batch-1 kernel fp32; the caller's fields win."""
    from warploop.llm.shapes import GPU_MODELS
    for _, cfg in GPU_MODELS.values():
        c = stream_config(cfg, batch_rows=64)
        assert (c.ring, c.x_stage_kb, c.x_stages, c.block_rows, c.block_k) == (8, 64, 4, 64, 128)
        assert c.shared_bytes <= 220 * 1024 and c.attn_wgmma
        c = stream_config(cfg, batch_rows=32)
        assert (c.ring, c.x_stage_kb, c.x_stages) == (8, 32, 4) and c.shared_bytes <= 220 * 1024
        assert (c.block_rows, c.block_k) == (64, 128)
        c = stream_config(cfg, batch_rows=16)
        assert (c.ring, c.x_stage_kb, c.x_stages) == (8, 32, 4) and c.shared_bytes <= 220 * 1024
        assert (c.block_rows, c.block_k) == (32, 256)
        assert stream_config(cfg).x_stages == 0
    c = stream_config(GPU_MODELS["llama-3.2-1b"][1], batch_rows=32, ring=4, x_stage_kb=64)
    assert (c.ring, c.x_stages, c.block_rows) == (4, 8, 64)


def test_batched_decoder_refuses_what_it_cannot_run():
    cfg = CONFIGS["llama3"]
    w = bf16_exact_weights(cfg)
    dec = StreamDecoder(cfg, w, max_context=16, block_size=4, batch=2)
    with pytest.raises(ValueError, match="1 to 2 row"):
        dec.step_rows([1, 1, 1], [0, 0, 0], [[0], [1], [2]])
    with pytest.raises(ValueError, match="row 1: token"):
        dec.step_rows([1, cfg.vocab_size], [0, 0], [[0], [1]])
    with pytest.raises(ValueError, match="row 0: positions"):
        dec.generate_rows([1, 1], [15, 0], 2, [[0, 1, 2, 3], [0]])
    with pytest.raises(ValueError, match="step_rows"):
        dec.step(1, 0)
    with pytest.raises(ValueError, match="batch"):
        StreamDecoder(cfg, w, max_context=16, block_size=4, batch=0)
    # before anything touches a GPU: a kernel compiled for one row, or more rows than any kernel takes
    with pytest.raises(ValueError, match="batch_rows is 0; use 16"):
        StreamDecoder(cfg, w, max_context=16, block_size=4, batch=2, device="cuda", config=stream_config(cfg))
    with pytest.raises(ValueError, match="at most 64 rows"):
        StreamDecoder(cfg, w, max_context=16, block_size=4, batch=65)
    assert [batch_rows(b) for b in (1, 2, 16, 17, 32, 33, 64)] == [0, 16, 16, 32, 32, 64, 64]
