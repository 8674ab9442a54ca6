"""`warploop bench decode`: LLM decode speed of the engine against HF transformers eager and a
gpt-fast-style torch.compile model, on the exact Llama-3.2-1B configuration with random bf16 weights.

All three are measured in one run, the same way: ms per output token at batch 1 and tokens/s at
batch 8 and 32 count decode steps only (prompt 32 tokens, prefill excluded), TTFT is one 1,024-token
prompt to its first token; each figure is the median of several runs. The floor is weight bytes
over the measured device-to-device copy bandwidth (bytes read + written). Before timing, the
engine's logits are checked against transformers on the same weights.

Without a GPU the command runs a small config on the CPU (the JSON says so) and skips the
torch.compile peer, which needs CUDA graphs.
"""
from __future__ import annotations

import argparse
import gc
import importlib.util
import statistics
import sys
import threading
import time

from warploop.bench.common import emit, header, result_path
from warploop.llm.config import ModelConfig
from warploop.llm.rope import RopeConfig

LLAMA_3_2_1B = ModelConfig(
    family="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32,
    num_kv_heads=8, head_dim=64, rms_norm_eps=1e-5, max_position_embeddings=131072, tie_word_embeddings=True,
    rope=RopeConfig(rope_type="llama3", theta=500000.0, factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=8192),
    dtype="bfloat16", eos_token_ids=(128001,), bos_token_id=128000)
SMALL_CPU = ModelConfig(
    family="llama", vocab_size=8192, hidden_size=256, intermediate_size=1024, num_layers=4, num_heads=8,
    num_kv_heads=2, head_dim=32, rms_norm_eps=1e-5, max_position_embeddings=4096, tie_word_embeddings=True,
    rope=LLAMA_3_2_1B.rope, dtype="float32")
PROMPT_LEN, TTFT_LEN, BATCHES = 32, 1024, (1, 8, 32)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from warploop.cli import positive_int

    parser.add_argument("--json", action="store_true", help="print only the JSON result")
    parser.add_argument("--steps", type=positive_int, default=None,
                        help="decode steps per run (default 128 on a GPU, 16 on the CPU)")
    parser.add_argument("--repeats", type=positive_int, default=3, help="runs per figure; the median is reported")
    parser.add_argument("--save", default=None, help="also write the JSON here (default: bench/results/ on a GPU)")
    parser.add_argument("--skip", action="append", default=[], choices=("hf_eager", "torch_compile"),
                        help="leave out a peer")


def main(args: argparse.Namespace) -> int:
    import torch

    gpu = torch.cuda.is_available()
    device = torch.device("cuda" if gpu else "cpu")
    cfg, dtype = (LLAMA_3_2_1B, torch.bfloat16) if gpu else (SMALL_CPU, torch.float32)
    steps = args.steps or (128 if gpu else 16)
    say = (lambda *a: None) if args.json else (lambda *a: print(*a, flush=True))
    result = header("decode")
    result["torch_device"] = torch.cuda.get_device_name(device) if gpu else "cpu"
    result.update(model=_describe(cfg, dtype, gpu), method={
        "prompt_tokens": PROMPT_LEN, "decode_steps": steps, "repeats": args.repeats, "ttft_prompt_tokens": TTFT_LEN,
        "ms_per_token": "decode steps only: (last token - first token) / steps, median of repeats",
        "tok_s": "batch x steps / decode time, all requests submitted together, median of repeats",
        "floor": "weight bytes / copy_gbps (device-to-device copy, bytes read + written)"})
    gen = torch.Generator(device=device).manual_seed(0)

    def prompts(batch: int, length: int = PROMPT_LEN):
        return torch.randint(0, cfg.vocab_size, (batch, length), device=device, generator=gen)

    result["copy_gbps"] = round(_copy_gbps(device), 1)
    nbytes = cfg.num_parameters() * torch.finfo(dtype).bits // 8
    result["weight_bytes"] = nbytes
    result["floor_ms"] = round(nbytes / (result["copy_gbps"] * 1e9) * 1e3, 4)
    say(f"floor {result['floor_ms']} ms ({nbytes / 1e9:.2f} GB at {result['copy_gbps']} GB/s)")

    from warploop.bench import decode_peers
    from warploop.llm.weights import fuse, random_weights

    if importlib.util.find_spec("transformers") is None:
        # The engine still runs (on random weights of the same shapes); transformers' figures and the
        # check against it cannot. Said on stderr so --json output stays one object.
        missing = {"skipped": "needs transformers: pip install transformers"}
        print("bench decode: hf_eager and the check against transformers skipped: pip install transformers",
              file=sys.stderr)
        engine = _engine(cfg, random_weights(cfg, device, dtype), device)
        result["warploop"] = {"check": missing}
        result["hf_eager"] = missing
    else:
        hf = decode_peers.hf_model(cfg, device, dtype)
        hf32 = decode_peers.hf_model(cfg, device, torch.float32)
        hf32.load_state_dict(hf.state_dict())
        state = hf.state_dict()
        engine = _engine(cfg, fuse(cfg, lambda name: state[name], device, dtype), device)
        result["warploop"] = {"check": _check(engine, hf, hf32, prompts(1)[0].tolist())}
        del hf32, state
        say(f"check against transformers: {result['warploop']['check']}")
        if "hf_eager" not in args.skip:
            result["hf_eager"] = _guard(_measure_hf, hf, prompts, args.repeats, max(8, steps // 4))
            say(f"hf_eager: {result['hf_eager']}")
        del hf
    result["warploop"].update(_guard(_measure_engine, engine, prompts, args.repeats, steps))
    say(f"warploop: {result['warploop']}")
    engine.close()
    del engine
    gc.collect()
    if gpu:
        torch.cuda.empty_cache()
    if "torch_compile" not in args.skip:
        result["torch_compile"] = _guard(_measure_compiled, cfg, device, dtype, prompts, args.repeats, steps) \
            if gpu else {"skipped": "needs a CUDA device (CUDA graphs)"}
        say(f"torch_compile: {result['torch_compile']}")
    result["ratios"] = _ratios(result)
    emit(result, args.save or (result_path("decode") if gpu else None))
    return 0


def _describe(cfg: ModelConfig, dtype, gpu: bool) -> dict:
    return {"config": "Llama-3.2-1B (exact shapes)" if gpu else "small Llama (no GPU: CPU run, not Llama-3.2-1B)",
            "hidden": cfg.hidden_size, "layers": cfg.num_layers, "heads": cfg.num_heads, "kv_heads": cfg.num_kv_heads,
            "intermediate": cfg.intermediate_size, "vocab": cfg.vocab_size, "tied": cfg.tie_word_embeddings,
            "rope": cfg.rope.rope_type, "dtype": str(dtype).removeprefix("torch."), "weights": "random",
            "parameters": cfg.num_parameters()}


def _copy_gbps(device) -> float:
    import torch

    n = (1 << 30) if device.type == "cuda" else (1 << 26)
    x = torch.randint(0, 255, (n,), dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    times = [_timed(lambda: y.copy_(x), device) for _ in range(20)]
    return 2 * n / statistics.median(times[5:]) / 1e9


def _timed(fn, device) -> float:
    import torch

    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _engine(cfg: ModelConfig, weights, device):
    """The engine over `weights` (a copy of the transformers model's, fused, when transformers is installed)."""
    from warploop.llm.build import build_backend
    from warploop.llm.engine import Engine

    max_len = 2048
    backend, max_context = build_backend(cfg, weights, device, block_size=16, num_kv_blocks=(64 * max_len) // 16,
                                         max_num_seqs=max(BATCHES), max_model_len=max_len)
    return Engine(cfg, backend, None, model_name="llama-3.2-1b-random", max_context=max_context,
                  max_num_seqs=max(BATCHES), max_batch_tokens=4096, enable_prefix_caching=False)


def _check(engine, hf, hf32, prompt: list[int]) -> dict:
    """Engine vs transformers on the same weights, both against transformers in float32 (the
    reference): logits of the prompt's last token and of 8 decode steps fed the same tokens, and
    how many of 16 greedy tokens agree with transformers' in the same dtype."""
    import torch

    from warploop.llm.backend import ModelBatch
    from warploop.llm.params import SamplingParams
    from warploop.llm.sequence import Sequence

    out = engine.generate(prompt, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)).token_ids
    n = len(prompt)
    with torch.no_grad():
        ids = torch.tensor([prompt + out[:8]], device=hf.device)
        ref = hf32(ids).logits[0, n - 1:].float()
        theirs = hf(ids).logits[0, n - 1:].float()
        ref_tokens = hf.generate(ids[:, :n], attention_mask=torch.ones_like(ids[:, :n]), max_new_tokens=16,
                                 min_new_tokens=16, do_sample=False)[0, n:].tolist()
    seq = Sequence(prompt + out[:8], None)
    engine.blocks.allocate(seq)  # safe: the engine is idle between requests
    batch = ModelBatch(seq.token_ids, list(range(len(seq))), [len(seq)], [len(seq)], [seq.block_table],
                       logits_indices=list(range(n - 1, len(seq))))
    ours = engine.backend.forward(batch)
    engine.blocks.free(seq)

    def err(a, b):
        return round(((a - b).norm(dim=-1) / b.norm(dim=-1)).max().item(), 5)

    agree = next((i for i, (a, b) in enumerate(zip(out, ref_tokens, strict=True)) if a != b), len(out))
    return {"rel_err_vs_fp32": err(ours, ref), "hf_same_dtype_rel_err_vs_fp32": err(theirs, ref),
            "rel_err_vs_hf_same_dtype": err(ours, theirs), "positions": len(seq) - n + 1,
            "greedy_tokens_equal_to_transformers": agree, "of": len(out)}


def _guard(fn, *args) -> dict:
    try:
        return fn(*args)
    except Exception as e:  # one failing system must not lose the others' figures
        import traceback

        traceback.print_exc()
        return {"error": f"{type(e).__name__}: {e}"[:500]}


def _measure_engine(engine, prompts, repeats: int, steps: int) -> dict:
    from warploop.llm.params import SamplingParams

    params = SamplingParams(max_tokens=steps + 1, temperature=0, ignore_eos=True)
    engine.generate(prompts(1)[0].tolist(), params)  # warm-up
    out = {"ms_per_token_bs1": _median(repeats, lambda: engine.generate(prompts(1)[0].tolist(), params).ms_per_token)}
    for batch in BATCHES[1:]:
        out[f"tok_s_bs{batch}"] = _median(repeats, lambda b=batch: _engine_tok_s(engine, prompts(b), params, steps))
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    engine.generate(prompts(1, TTFT_LEN)[0].tolist(), one)
    out["ttft_ms_1024"] = _median(repeats, lambda: engine.generate(prompts(1, TTFT_LEN)[0].tolist(), one).ttft_ms)
    out["engine_stats"] = engine.stats()
    return out


def _engine_tok_s(engine, batch, params, steps: int) -> float:
    """All requests at once; time from the step that gave every request its first token to the last."""
    firsts, lasts, done = [], [], threading.Semaphore(0)

    def on_event(event):
        now = time.perf_counter()
        if event.completion_tokens == 1:
            firsts.append(now)
        if event.finish_reason is not None:
            lasts.append(now)
            done.release()

    for row in batch.tolist():
        engine.add_request(row, params, on_event)
    for _ in range(len(batch)):
        done.acquire()
    return len(batch) * steps / (max(lasts) - max(firsts))


def _measure_hf(model, prompts, repeats: int, steps: int) -> dict:
    from warploop.bench.decode_peers import hf_generate_s

    def decode_s(batch):
        p = prompts(batch)
        return hf_generate_s(model, p, steps + 1) - hf_generate_s(model, p, 1)

    decode_s(1)  # warm-up
    out = {"ms_per_token_bs1": _median(repeats, lambda: decode_s(1) / steps * 1e3), "decode_steps": steps}
    for batch in BATCHES[1:]:
        out[f"tok_s_bs{batch}"] = _median(repeats, lambda b=batch: b * steps / decode_s(b))
    hf_generate_s(model, prompts(1, TTFT_LEN), 1)
    out["ttft_ms_1024"] = _median(repeats, lambda: hf_generate_s(model, prompts(1, TTFT_LEN), 1) * 1e3)
    return out


def _measure_compiled(cfg, device, dtype, prompts, repeats: int, steps: int) -> dict:
    from warploop.bench.decode_peers import CompiledDecoder, gptfast_model

    decoder = CompiledDecoder(gptfast_model(cfg, device, dtype), use_cuda_graphs=True)
    max_len = -(-(PROMPT_LEN + steps + 1) // 64) * 64
    out, compile_s = {}, {}
    for batch in BATCHES:
        t0 = time.perf_counter()
        decoder.decode_s(prompts(batch), 8, max_len)  # compiles and records the graph for this batch size
        decoder.decode_s(prompts(batch), 8, max_len)
        compile_s[f"bs{batch}"] = round(time.perf_counter() - t0, 1)
        runs = _median(repeats, lambda b=batch: decoder.decode_s(prompts(b), steps, max_len))
        out["ms_per_token_bs1" if batch == 1 else f"tok_s_bs{batch}"] = \
            runs / steps * 1e3 if batch == 1 else batch * steps / runs
    t0 = time.perf_counter()
    decoder.ttft_s(prompts(1, TTFT_LEN), TTFT_LEN + 64)
    compile_s["prefill_1024"] = round(time.perf_counter() - t0, 1)
    out["ttft_ms_1024"] = _median(repeats, lambda: decoder.ttft_s(prompts(1, TTFT_LEN), TTFT_LEN + 64) * 1e3)
    out["compile_s"] = compile_s
    return out


def _median(repeats: int, fn) -> float:
    return round(statistics.median(fn() for _ in range(repeats)), 3)


def _ratios(result: dict) -> dict:
    def get(system, key):
        value = result.get(system, {}).get(key)
        return value if isinstance(value, (int, float)) and value > 0 else None

    out = {}
    ours = get("warploop", "ms_per_token_bs1")
    if ours:
        out["floor_over_warploop_bs1"] = round(result["floor_ms"] / ours, 3)
        for peer in ("hf_eager", "torch_compile"):
            theirs = get(peer, "ms_per_token_bs1")
            if theirs:
                out[f"{peer}_ms_over_warploop_ms_bs1"] = round(theirs / ours, 3)
    for batch in BATCHES[1:]:
        ours = get("warploop", f"tok_s_bs{batch}")
        for peer in ("hf_eager", "torch_compile"):
            theirs = get(peer, f"tok_s_bs{batch}")
            if ours and theirs:
                out[f"warploop_over_{peer}_tok_s_bs{batch}"] = round(ours / theirs, 3)
    return out
