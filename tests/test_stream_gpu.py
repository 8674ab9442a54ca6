"""The streaming executor on a Hopper GPU against the CPU reference, node by node (skips elsewhere).

Run on the device machine: scripts/device_stream.sh."""
import dataclasses
import os

import pytest

os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")

import torch  # noqa: E402
from no_triton import BLOCK_TRITON  # noqa: E402
from test_stream_program import SHAPES, small  # noqa: E402
from test_stream_step import CONFIGS as STEP_CONFIGS  # noqa: E402
from test_stream_step import (  # noqa: E402
    WGMMA_MODELS,
    assert_like_per_op,
    batch_against_per_op,
    greedy,
    levels_against_one_program,
)

from warploop.bench import stream_chain  # noqa: E402
from warploop.llm.stream_step import batch_rows, stream_config  # noqa: E402
from warploop.runtime.stream.compiled import StreamConfig  # noqa: E402
from warploop.runtime.stream.executor import StreamError, StreamExecutor  # noqa: E402
from warploop.runtime.stream.kinds import TRACE_STAMPS, WORDS, header_word  # noqa: E402
from warploop.runtime.stream.reference import first_difference, reference  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                                reason="needs a Hopper GPU")
CONFIGS = [StreamConfig(kmax=512), StreamConfig(block_rows=16, block_k=128, ring=12, kmax=512),
           StreamConfig(block_rows=64, block_k=64, ring=4, kmax=512)]


@pytest.mark.parametrize("cfg", CONFIGS, ids=["32x256", "16x128", "64x64"])
@pytest.mark.parametrize("name", SHAPES)
def test_gpu_equals_reference_node_by_node(name, cfg):
    chain = stream_chain.layer_chain(SHAPES[name], cfg, device="cuda", seed=hash(name) % 1000)
    p = chain.program
    start = p.arena("cuda")
    for name in ("qkv", "act", "logits"):        # poison what the step writes before reading it
        chain.view(start, name).fill_(float("nan"))
    want = reference(p, start)
    ex = StreamExecutor(p)
    ex.arena.copy_(start)
    ex.run(timeout=60)
    assert first_difference(p, ex.arena, want, rtol=1e-4) is None
    # later runs wait on counters at need * (epoch + 1): the same program again from the same start
    for _ in range(3):
        ex.arena.copy_(start)
        ex.run(timeout=60)
    assert first_difference(p, ex.arena, want, rtol=1e-4) is None


def test_gpu_trace_stamps_are_causal():
    """StreamConfig.trace: every GEMV's stamps run in order (start, waits met, first chunk,
    published), its loader's first slot comes before the consumer holds the chunk, the loader's
    time waiting for slots is within the run, and the consumer's wait for its later chunks within
    its first chunk to published; the outputs are the untraced kernel's."""
    name = next(iter(SHAPES))
    chain = stream_chain.layer_chain(SHAPES[name], StreamConfig(kmax=512, trace=True), device="cuda", seed=3)
    start = chain.program.arena("cuda")
    want = reference(chain.program, start)
    ex = StreamExecutor(chain.program)
    ex.arena.copy_(start)
    ex.run(timeout=60)
    assert first_difference(chain.program, ex.arena, want, rtol=1e-4) is None
    st = ex.trace.cpu()
    gemv = [j for j, i in enumerate(ex.built.instructions) if i.kind.name == "gemv"]
    assert gemv and st.shape[1] == len(TRACE_STAMPS) == 7
    s = st[gemv]
    assert (s[:, 0] > 0).all() and (s[:, 4] > 0).all()
    assert (s[:, 0] <= s[:, 1]).all() and (s[:, 1] <= s[:, 2]).all() and (s[:, 2] <= s[:, 3]).all()
    assert (s[:, 4] <= s[:, 2]).all()
    span = int(st[:, 3].max() - st[:, 0][st[:, 0] > 0].min())
    assert (s[:, 5] >= 0).all() and (s[:, 5] <= span).all()
    assert (s[:, 6] >= 0).all() and (s[:, 6] <= s[:, 3] - s[:, 2]).all()


PREBUILT_CHILD = BLOCK_TRITON + """
from test_stream_gpu import prebuilt_run
print(prebuilt_run(sys.argv[1]))
"""


def prebuilt_run(folder):
    """A layer chain with attention run by the prebuilt kernel in `folder`, against the reference:
    the first difference (None when there is none)."""
    m = SHAPES["llama_gqa"]
    cfg = dataclasses.replace(CONFIGS[0], head_dim=m.head_dim, attn_group=8)
    chain = stream_chain.layer_chain(m, cfg, device="cuda", context=300, block_size=16, splits=3)
    p = chain.program
    start = p.arena("cuda")
    want = reference(p, start, kv=p.kv.clone())
    ex = StreamExecutor(p, prebuilt=folder)
    ex.arena.copy_(start)
    ex.run(timeout=60)
    return first_difference(p, ex.arena, want, rtol=3e-3, start=start)


def test_gpu_prebuilt_kernel_runs_with_no_triton(tmp_path):
    """The kernel compiled ahead of time (prebuilt.write_variant) and launched through the CUDA driver
    gives the reference's outputs, in a process where importing Triton fails; a folder without the
    program's variant is refused by name."""
    import subprocess
    import sys

    from warploop.runtime.stream.prebuilt import write_variant
    m = SHAPES["llama_gqa"]
    write_variant(dataclasses.replace(CONFIGS[0], head_dim=m.head_dim, attn_group=8), tmp_path, block_size=16)
    assert prebuilt_run(tmp_path) is None
    out = subprocess.run([sys.executable, "-c", PREBUILT_CHILD, str(tmp_path)], capture_output=True, text=True,
                         cwd=os.path.dirname(__file__), timeout=300)
    assert out.returncode == 0 and out.stdout.strip().splitlines()[-1] == "None", out.stderr[-2000:]
    chain = stream_chain.layer_chain(m, CONFIGS[0], device="cuda")
    with pytest.raises(ValueError, match="no prebuilt kernel"):
        StreamExecutor(chain.program, prebuilt=tmp_path)


def test_gpu_shipped_kernel_gives_the_compiled_kernels_logits():
    """prebuilt="auto" (WARPLOOP_STREAM_PREBUILT=auto): a model of a shipped shape (the tiny model's:
    widest input 1024, head_dim 64, group 2), with the engine's 16-token KV blocks, launches the
    package's prebuilt kernel, and its steps and its decode loop give the compiled kernel's."""
    from pathlib import Path

    from test_stream_step import bf16_exact_weights

    from warploop.llm import stream_step
    from warploop.llm.config import ModelConfig
    from warploop.llm.stream_step import StreamDecoder
    cfg = ModelConfig.from_dir(str(Path(stream_step.__file__).with_name("tiny")))
    w = bf16_exact_weights(cfg, "cuda")
    decs = {s: StreamDecoder(cfg, w, device="cuda", max_context=64, block_size=16, prebuilt=s) for s in ("auto", "off")}
    assert decs["auto"].compiles == "" and decs["auto"].executor.prebuilt is not None
    assert decs["off"].executor.prebuilt is None
    for pos, tok in enumerate([3, 17, 5, 60, 2, 41, 9, 11]):
        got, want = decs["auto"].step(tok, pos).float(), decs["off"].step(tok, pos).float()
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3 * want.abs().max().item())
    loops = {s: StreamDecoder(cfg, w, device="cuda", max_context=64, block_size=16, prebuilt=s).generate(3, 0, 12)
             for s in ("auto", "off")}
    assert loops["auto"] == loops["off"]


# the CPU tests' shapes (head_dim 16), and the bench models' head sizes
ATTN_SHAPES = SHAPES | {"llama_hd64": small(head_dim=64), "qwen3_hd128": small(family="qwen3", head_dim=128)}


@pytest.mark.parametrize("context, splits, block_size", [(1, 1, 4), (37, 1, 4), (300, 1, 4), (37, 3, 4), (300, 7, 4),
                                                         (5, 4, 4), (300, 7, 16), (300, 3, 64), (130, 1, 32),
                                                         (1000, 5, 16)])
@pytest.mark.parametrize("name", ATTN_SHAPES)
def test_gpu_attention_layers_equal_reference(name, context, splits, block_size):
    """Whole layers with attention (ATTN nodes: q/k norm, RoPE, the paged KV write, GQA softmax over
    a shuffled block table, the context streamed by the loader in TMA boxes of up to a block, the
    shares merged by the last one to finish) against the reference, node by node, and the KV caches
    they leave."""
    m = ATTN_SHAPES[name]
    cfg = dataclasses.replace(CONFIGS[0], head_dim=m.head_dim, attn_group=8)
    chain = stream_chain.layer_chain(m, cfg, device="cuda", context=context, block_size=block_size,
                                      splits=splits)
    p = chain.program
    start, kv0 = p.arena("cuda"), p.kv.clone()
    for region in ("qkv", "act", "logits", "attn") + (("part",) if splits > 1 else ()):
        chain.view(start, region).fill_(float("nan"))
    want_kv = kv0.clone()
    want = reference(p, start, kv=want_kv)
    ex = StreamExecutor(p)
    ex.arena.copy_(start)
    ex.run(timeout=60)
    # k is rounded to bf16 after fp32 math whose order differs: a rare one-ulp flip moves outputs ~1e-3
    assert first_difference(p, ex.arena, want, rtol=3e-3, start=start) is None
    assert chain.view(ex.arena, "logits").isfinite().all()
    torch.testing.assert_close(ex.kv.float(), want_kv.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("name", STEP_CONFIGS)
def test_gpu_stream_step_greedy_tokens_equal_per_op_backend(name, splits):
    """A model's decode steps on the streaming kernel give the per-op backend's greedy tokens."""
    cfg = STEP_CONFIGS[name]
    tokens, ref_tokens, err, looped = greedy(cfg, "cuda", splits=splits, config=stream_config(cfg))
    assert tokens == ref_tokens
    assert looped == ref_tokens             # the decode loop in one launch
    assert err < 2e-2


@pytest.mark.parametrize("defer", [False, True])
def test_gpu_stream_step_levels_give_the_one_program_logits(defer):
    """The decoder's split-level programs, run by executors over one arena, against one program
    of the largest level: the same logits step by step across both level boundaries, and the
    same decode loop; with defer (the engine's), the middle level's executor is made when a step
    first needs it."""
    levels, err, looped, ref = levels_against_one_program("cuda", defer=defer)
    assert levels == [1, 2, 4]
    assert err < 1e-3, f"logits differ by {err:.3g}"
    assert looped == ref


@pytest.mark.parametrize("cross", [False, True], ids=["same_cta", "cross_cta"])
def test_dependent_stage_chain(cross):
    p = stream_chain.stage_chain(StreamConfig(kmax=256), 200, cross, device="cuda")
    ex = StreamExecutor(p)
    ex.run(timeout=60)
    assert first_difference(p, ex.arena, reference(p, p.arena("cuda")), rtol=1e-4) is None


def test_an_executor_shares_memory_only_with_a_variant_of_its_program():
    a = stream_chain.stage_chain(StreamConfig(kmax=256), 8, True, device="cuda")
    b = stream_chain.stage_chain(StreamConfig(kmax=256), 9, True, device="cuda")     # one region more
    ex = StreamExecutor(a)
    with pytest.raises(ValueError, match="same regions"):
        StreamExecutor(b, share=ex)
    twin = StreamExecutor(a, share=ex)                   # the same program: the same memory
    assert twin.arena is ex.arena and twin.ints is ex.ints
    twin.run(timeout=60)
    assert first_difference(a, ex.arena, reference(a, a.arena("cuda")), rtol=1e-4) is None


def test_a_kernel_for_fewer_rows_refuses_a_batched_program():
    from test_stream_step import CONFIGS as STEP
    from test_stream_step import bf16_exact_weights

    from warploop.llm.stream_step import StreamDecoder
    cfg = STEP["llama3"]
    w = bf16_exact_weights(cfg)
    dec = StreamDecoder(cfg, w, max_context=16, block_size=4, batch=2, config=stream_config(cfg))   # on the CPU
    with pytest.raises(ValueError, match="compiled for 1 row"):
        StreamExecutor(dec.program, "cuda")
    dec = StreamDecoder(cfg, w, max_context=16, block_size=4, batch=20, config=stream_config(cfg, batch_rows=16))
    with pytest.raises(ValueError, match="compiled for 16 row"):
        StreamExecutor(dec.program, "cuda")


@pytest.mark.parametrize("batch, tiles", [(2, 32), (8, 32), (16, 32), (17, 32), (32, 32), (8, 64), (17, 64),
                                         (32, 64), (33, 64), (64, 64)])
def test_gpu_batched_decoder_gives_the_per_op_backends_tokens(batch, tiles):
    """Batches on the streaming kernel (its GEMVs on tensor cores against every row, attention,
    embedding and sampling a row each), every row its own position and blocks: the per-op
    backend's logits and its clear greedy picks, and the loop equal to the steps, as on the CPU (every
    GEMV reading CAST nodes' bf16 rows; tiles of 64 rows: on wgmma)."""
    cfg = STEP_CONFIGS["qwen3_qk_norm"]
    config = stream_config(cfg, batch_rows=batch_rows(batch), block_rows=tiles, block_k=128 if tiles == 64 else 256)
    want, got, looped, stepped = batch_against_per_op(cfg, batch, device="cuda", config=config)
    assert_like_per_op(want, got, looped, stepped)


@pytest.mark.parametrize("batch, tiles, block_k", [(8, 64, 128), (17, 64, 128), (32, 64, 128)])
def test_gpu_split_k_decoder_gives_the_per_op_backends_tokens(batch, tiles, block_k, monkeypatch):
    """o_proj and down split K (stream_record.k_splits, forced to one chunk a split): each split's
    tiles stream their own columns and store partial sums, which the CAST nodes add into the
    residual; the per-op backend's logits and clear picks, and the loop equal to the steps."""
    from warploop.llm import stream_record
    monkeypatch.setattr(stream_record, "KSPLIT_CHUNKS", 1)
    cfg = dataclasses.replace(WGMMA_MODELS["hd64"], intermediate_size=512)
    config = stream_config(cfg, batch_rows=batch_rows(batch), block_rows=tiles, block_k=block_k)
    assert stream_record.k_splits(cfg.hidden_size, cfg.intermediate_size, config) == 512 // block_k
    want, got, looped, stepped = batch_against_per_op(cfg, batch, device="cuda", config=config, block_size=16)
    assert_like_per_op(want, got, looped, stepped)


@pytest.mark.parametrize("model", WGMMA_MODELS)
@pytest.mark.parametrize("batch, context", [(2, 0), (17, 0), (32, 0), (8, 200), (32, 150)])
def test_gpu_batched_wgmma_attention_gives_the_per_op_backends_tokens(model, batch, context):
    """Attention's products on wgmma (StreamConfig.attn_wgmma: q and each chunk's probabilities as
    bf16 operands): the per-op backend's logits and clear greedy picks at batches of short and of
    several-chunk contexts, and the loop equal to the steps."""
    cfg = WGMMA_MODELS[model]
    config = stream_config(cfg, batch_rows=batch_rows(batch), attn_wgmma=True)
    want, got, looped, stepped = batch_against_per_op(cfg, batch, device="cuda", config=config, context=context,
                                                      block_size=16)
    assert_like_per_op(want, got, looped, stepped)


@pytest.mark.parametrize("batch", [8, 17, 32])
def test_gpu_wgmma_pipe_decoder_gives_the_per_op_backends_tokens(batch):
    """StreamConfig.wgmma_pipe: a chunk's wgmma products stay in flight while the next chunk's issue
    (its slot and x stages freed a chunk later, x zero past its end); the per-op backend's logits and
    clear picks, narrow tiles (qkv) and split K (o_proj, down) included."""
    cfg = dataclasses.replace(WGMMA_MODELS["hd64"], intermediate_size=512)
    config = stream_config(cfg, batch_rows=batch_rows(batch), block_rows=64, block_k=128, wgmma_pipe=True)
    want, got, looped, stepped = batch_against_per_op(cfg, batch, device="cuda", config=config, block_size=16)
    assert_like_per_op(want, got, looped, stepped)


@pytest.mark.parametrize("batch", [8, 17, 32])
def test_gpu_tall_tile_decoder_gives_the_per_op_backends_tokens(batch, monkeypatch):
    """StreamConfig.gemv_tall: gate/up and the lm_head as tall tiles (two ring slots a chunk at one x block;
    forced here for the small shapes); the per-op backend's logits and clear picks, and loops equal to steps."""
    from warploop.llm import stream_record
    monkeypatch.setattr(stream_record, "tall", lambda rows, config, ctas=132, silu=False: config.gemv_tall)
    cfg = dataclasses.replace(WGMMA_MODELS["hd64"], intermediate_size=512)
    config = stream_config(cfg, batch_rows=batch_rows(batch), block_rows=64, block_k=128, gemv_tall=True)
    want, got, looped, stepped = batch_against_per_op(cfg, batch, device="cuda", config=config, block_size=16)
    assert_like_per_op(want, got, looped, stepped)


@pytest.mark.parametrize("batch, context", [(8, 0), (17, 300), (32, 150)])
def test_gpu_kv_split_attention_at_head_dim_64_gives_the_per_op_backends_tokens(batch, context):
    """StreamConfig.attn_kv_split: at head_dim 64 a chunk's 128 keys fill a ring slot and their values
    the next; the per-op backend's logits and clear picks over one and several chunks."""
    cfg = WGMMA_MODELS["hd64"]
    config = stream_config(cfg, batch_rows=batch_rows(batch), attn_wgmma=True, attn_kv_split=True)
    assert config.kv_tokens == 128
    want, got, looped, stepped = batch_against_per_op(cfg, batch, device="cuda", config=config, context=context,
                                                      block_size=16)
    assert_like_per_op(want, got, looped, stepped)


def test_a_wait_that_is_never_met_reports_and_the_kernel_ends():
    p = stream_chain.stage_chain(StreamConfig(kmax=256, spin=20000), 8, True, device="cuda")
    ex = StreamExecutor(p)
    words = ex.words.view(-1, WORDS)
    waiting = (words[:, header_word("wait0")] >= 0).nonzero()[0, 0]
    words[waiting, header_word("need0")] = 1000          # more signals than the program has
    with pytest.raises(StreamError, match="gave up"):
        ex.run(timeout=60)
    words[waiting, header_word("need0")] = 1
    ex.counters.zero_()
    ex.epoch = 0
    ex.run(timeout=60)                                    # the executor is usable again


def test_gpu_stream_backend_loops_give_its_single_steps_tokens():
    """`--backend stream` through the engine on the GPU: greedy decode loops (the kernel picks and
    feeds each token) give the tokens of single steps (the host picks from the same kernel's
    logits); the first token is the per-op prefill's."""
    from warploop.llm.engine import Engine, SamplingParams
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    outs, stats = {}, {}
    for name, options in (("torch", {}), ("stream", {}), ("steps", dict(decode_loop=False))):
        backend = "torch" if name == "torch" else "stream"
        with Engine.from_model("tiny", device="cuda", dtype="bfloat16", backend=backend, max_num_seqs=1,
                               progress=False, **options) as engine:
            outs[name] = engine.generate("def main(", params).token_ids
            stats[name] = engine.stats()
    assert outs["stream"] == outs["steps"] and len(outs["stream"]) == 40
    assert outs["stream"][0] == outs["torch"][0]
    assert stats["stream"]["decode_loops"] >= 2 and stats["steps"]["decode_loops"] == 0


def test_gpu_stream_sampled_loops_draw_what_single_steps_draw():
    """A request at a temperature alone, seeded: the kernel draws every token (Gumbel-max,
    runtime/stream/sampling.py) in loops and in single steps alike, and a step's pick is the race
    winner of its own logits under philox.py's noise."""
    import numpy as np

    from warploop.llm.engine import Engine, SamplingParams
    from warploop.runtime.stream import philox
    params = SamplingParams(max_tokens=40, temperature=0.9, seed=1234, ignore_eos=True)
    outs = {}
    for name, options in (("loops", {}), ("steps", dict(decode_loop=False))):
        with Engine.from_model("tiny", device="cuda", dtype="bfloat16", backend="stream", max_num_seqs=1,
                               progress=False, **options) as engine:
            outs[name] = engine.generate("def main(", params).token_ids
            assert (engine.stats()["decode_loops"] > 0) == (name == "loops")
            dec = engine.backend.decoder
            logits = dec.step(7, 3, [0], sampling=(0.9, 77)).float().cpu().numpy()
            race = logits / np.float32(0.9) + philox.gumbel(77, 4, np.arange(logits.size))
            assert dec.tokens(1)[0] == int(np.argmax(race))
    assert outs["loops"] == outs["steps"] and len(set(outs["loops"])) > 5


def test_gpu_stream_batches_give_each_requests_own_tokens(monkeypatch):
    """WARPLOOP_STREAM_ROWS=8 on the GPU: six greedy requests together (their own budgets) run
    decode loops of the batch on the batched kernel and give each request's tokens alone (batch 1
    on the stream); every lent block back."""
    from test_mk_engine import run_together

    from warploop import config
    from warploop.llm.engine import Engine, SamplingParams
    prompts = ("def main(", "class A:\n", "import os", "x = [", "# note", "for i in")
    requests = [(p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
                for p, n in zip(prompts, (5, 17, 40, 33, 12, 24), strict=True)]

    def run(batch):
        with Engine.from_model("tiny", device="cuda", dtype="bfloat16", backend="stream", max_num_seqs=8,
                               progress=False) as engine:
            if batch:
                outs = run_together(engine, [(engine.tokenizer.encode(p), params) for p, params in requests])
                return [outs[i] for i in range(len(requests))], engine.stats()
            return [engine.generate(p, params).token_ids for p, params in requests], engine.stats()

    alone, _ = run(False)
    monkeypatch.setenv("WARPLOOP_STREAM_ROWS", "8")
    config.reload()
    try:
        together, stats = run(True)
    finally:
        monkeypatch.delenv("WARPLOOP_STREAM_ROWS")
        config.reload()
    assert together == alone and stats["decode_loops"] >= 3 and stats["kv_blocks_used"] == 0
