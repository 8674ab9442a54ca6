"""`warploop bench decode`: LLM decode speed of the engine's backends (the decode megakernel, the
streaming executor's `stream` and the per-op torch backend) against HF transformers eager and a
gpt-fast-style torch.compile model, per model shape (Llama-3.2-1B, Qwen3-0.6B, SmolLM2-135M; random bf16 weights).

Every system is measured in one run, the same way: ms per output token at batch 1 and tokens/s at
batch 8 and 32 count decode steps only (prompt 32 tokens, prefill excluded), TTFT is one 1,024-token
prompt to its first token; each figure is the median of several runs. The floor is weight bytes
over the measured device-to-device copy bandwidth (bytes read + written). Before timing, each
backend's decode-step logits are checked against transformers on the same weights (float32 reference).

Without a GPU the command runs a small config on the CPU (the JSON says so) and skips the
torch.compile peer (it needs CUDA graphs), the stream backend (its CPU reference is a check, not a
speed) and the megakernel (the CPU executor runs its graph
through the Triton interpreter: a reference for correctness, not a speed).
"""
from __future__ import annotations

import argparse
import gc
import importlib.util
import statistics
import sys
import threading
import time

from warploop.bench.common import checkpoint, emit, header, result_path
from warploop.bench.decode_check import check_logits
from warploop.bench.timing import seconds
from warploop.llm.config import ModelConfig
from warploop.llm.shapes import CPU_MODELS, GPU_MODELS, LLAMA_3_2_1B, QWEN3_0_6B, SMALL_CPU, SMOLLM2_135M  # noqa: F401

SYSTEMS = ("megakernel", "stream", "warploop", "torch_compile", "hf_eager")
PROMPT_LEN, TTFT_LEN, BATCHES = 32, 1024, (1, 8, 32)
ENGINE_MAX_LEN = 2048           # the measured engines' context: the prompt, then --steps + 1 tokens
# a 1,024-token TTFT is 5-20 ms, host-bound, and one backend's moves by 2x from run to run (BENCHMARKS.md,
# Decode, session 19): its median takes at least this many runs (each costs milliseconds)
TTFT_RUNS = 11


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from warploop.args import positive_int

    parser.add_argument("--json", action="store_true", help="print only the JSON result")
    parser.add_argument("--models", default=None,
                        help="comma-separated model shapes (default: all of " + ", ".join(GPU_MODELS) +
                        " on a GPU; small-cpu without one)")
    parser.add_argument("--steps", type=positive_int, default=None,
                        help="decode steps per run (default 128 on a GPU, 16 on the CPU)")
    parser.add_argument("--repeats", type=positive_int, default=3, help="runs per figure; the median is reported")
    parser.add_argument("--batches", default=None,
                        help="comma-separated batch sizes for tokens/s (default 8,32; batch 1 is always measured)")
    parser.add_argument("--no-ttft", action="store_true", help="leave out the 1,024-token TTFT figures")
    parser.add_argument("--save", default=None, help="also write the JSON here (default: bench/results/ on a GPU)")
    parser.add_argument("--skip", action="append", default=[], choices=SYSTEMS, help="leave out a system")


def _parse_models(text: str | None, gpu: bool) -> dict:
    known = GPU_MODELS | CPU_MODELS
    if text is None:
        return GPU_MODELS if gpu else CPU_MODELS
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in known]
    if bad or not names:
        raise SystemExit(f"bench decode: --models {text!r}: unknown model {', '.join(bad) or '(none)'}; "
                         f"choose from {', '.join(known)}")
    return {n: known[n] for n in names}


def _parse_batches(text: str | None) -> tuple[int, ...]:
    if text is None:
        return BATCHES[1:]
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        values = ()
    if not values or any(not 1 < v <= 256 for v in values):
        raise SystemExit(f"bench decode: --batches {text!r}: give batch sizes in 2..256, e.g. --batches 8,32")
    return values


def main(args: argparse.Namespace) -> int:
    import torch

    gpu = torch.cuda.is_available()
    device = torch.device("cuda" if gpu else "cpu")
    models = _parse_models(args.models, gpu)
    batches = _parse_batches(args.batches)
    skip = set(args.skip) | (set() if gpu else {"megakernel", "stream", "torch_compile"})
    steps = args.steps or (128 if gpu else 16)
    if PROMPT_LEN + steps + 1 > ENGINE_MAX_LEN:
        most = ENGINE_MAX_LEN - PROMPT_LEN - 1
        raise SystemExit(f"bench decode: --steps {steps}: the engines hold {ENGINE_MAX_LEN} tokens, a "
                         f"{PROMPT_LEN}-token prompt and steps + 1 more; give at most {most}")
    say = (lambda *a: None) if args.json else (lambda *a: print(*a, flush=True))
    result = header("decode")
    result["torch_device"] = torch.cuda.get_device_name(device) if gpu else "cpu"
    result["method"] = {
        "prompt_tokens": PROMPT_LEN, "decode_steps": steps, "repeats": args.repeats, "ttft_prompt_tokens": TTFT_LEN,
        "ms_per_token": "decode steps only: (last token - first token) / steps, median of repeats",
        "tok_s": "batch x steps / decode time, all requests submitted together, median of repeats",
        "ttft": f"submit to first token of a {TTFT_LEN}-token prompt, median of max(repeats, {TTFT_RUNS}) runs",
        "floor": "weight bytes / copy_gbps (device-to-device copy, bytes read + written)",
        "check": "decode-step logits vs transformers in float32 on the same weights (max relative L2 error)"}
    result["copy_gbps"] = round(_copy_gbps(device), 1)
    result["models"] = {}
    save = args.save or (result_path("decode") if gpu else None)
    for name, (title, cfg) in models.items():
        say(f"== {name}")
        entry = result["models"][name] = _bench_model(title, cfg, device, gpu, skip, steps, args.repeats, batches,
                                                      not args.no_ttft, result["copy_gbps"], say)
        entry["ratios"] = _ratios(entry, batches)
        checkpoint(result, save)
    emit(result, save)
    return 0


def _bench_model(title, cfg, device, gpu, skip, steps, repeats, batches, ttft, copy_gbps, say) -> dict:
    import torch

    dtype = torch.bfloat16 if gpu else torch.float32
    gen = torch.Generator(device=device).manual_seed(0)

    def prompts(batch: int, length: int = PROMPT_LEN):
        return torch.randint(0, cfg.vocab_size, (batch, length), device=device, generator=gen)

    entry = {"model": _describe(title, cfg, dtype)}
    nbytes = cfg.num_parameters() * torch.finfo(dtype).bits // 8
    entry["weight_bytes"] = nbytes
    entry["floor_ms"] = round(nbytes / (copy_gbps * 1e9) * 1e3, 4)
    say(f"floor {entry['floor_ms']} ms ({nbytes / 1e9:.3f} GB at {copy_gbps} GB/s)")

    from warploop.bench import decode_peers
    from warploop.llm.weights import fuse, random_weights

    hf = hf32 = None
    if importlib.util.find_spec("transformers") is None:
        # The engine still runs (on random weights of the same shapes); transformers' figures and the
        # check against it cannot. Said on stderr so --json output stays one object.
        print("bench decode: hf_eager and the check against transformers skipped: pip install transformers",
              file=sys.stderr)
        weights = random_weights(cfg, device, dtype)
        entry["hf_eager"] = {"skipped": "needs transformers: pip install transformers"}
    else:
        hf = decode_peers.hf_model(cfg, device, dtype)
        hf32 = decode_peers.hf_model(cfg, device, torch.float32)
        hf32.load_state_dict(hf.state_dict())
        state = hf.state_dict()
        weights = fuse(cfg, lambda n: state[n], device, dtype)
        del state
    check_prompt = prompts(1)[0].tolist()
    for system, backend in (("warploop", "torch"), ("megakernel", "megakernel"), ("stream", "stream")):
        if system in skip:
            entry[system] = {"skipped": "--skip" if gpu or system == "warploop" else
                             "CPU: the graph runs through the Triton interpreter (a reference, not a speed)"
                             if system == "megakernel" else "CPU: the streaming program runs its CPU reference "
                             "(a check, not a speed)"}
            continue
        if system == "stream" and dtype != torch.bfloat16:
            entry[system] = {"skipped": "the streaming backend runs bfloat16 models"}
            continue
        entry[system] = _guard(_measure_system, cfg, weights, device, backend, hf, hf32, check_prompt, prompts,
                               repeats, steps, batches, ttft)
        say(f"{system}: {entry[system]}")
        gc.collect()
        if gpu:
            torch.cuda.empty_cache()
    del hf32, weights
    if hf is not None and "hf_eager" not in skip:
        entry["hf_eager"] = _guard(_measure_hf, hf, prompts, repeats, max(8, steps // 4), batches, ttft)
        say(f"hf_eager: {entry['hf_eager']}")
    del hf
    gc.collect()
    if gpu:
        torch.cuda.empty_cache()
    if "torch_compile" not in skip:
        entry["torch_compile"] = _guard(_measure_compiled, cfg, device, dtype, prompts, repeats, steps, batches, ttft)
        say(f"torch_compile: {entry['torch_compile']}")
    elif not gpu:
        entry["torch_compile"] = {"skipped": "needs a CUDA device (CUDA graphs)"}
    gc.collect()
    if gpu:
        torch.cuda.empty_cache()
    return entry


def _measure_system(cfg, weights, device, backend, hf, hf32, check_prompt, prompts, repeats, steps, batches,
                    ttft) -> dict:
    t0 = time.perf_counter()
    engine = _engine(cfg, weights, device, backend)
    out = {"start_s": round(time.perf_counter() - t0, 1)}   # the megakernel's: its compile, on a cold cache
    engine.settle()             # what the engine defers from its start (the stream's split levels), done
    if hasattr(engine.backend, "graph_rows"):   # the megakernel: which decode batches ran on its graph
        out["graph_rows"] = engine.backend.graph_rows or "all"
        out["batch1_kernel"] = engine.backend.batch1_kernel
    try:
        out["check"] = check_logits(engine, hf, hf32, check_prompt) if hf is not None else \
            {"skipped": "needs transformers: pip install transformers"}
        out.update(_measure_engine(engine, prompts, repeats, steps, batches, ttft))
    finally:
        engine.close()
    return out


def _describe(title: str, cfg: ModelConfig, dtype) -> dict:
    return {"config": title, "family": cfg.family, "hidden": cfg.hidden_size, "layers": cfg.num_layers,
            "heads": cfg.num_heads, "kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
            "intermediate": cfg.intermediate_size, "vocab": cfg.vocab_size, "tied": cfg.tie_word_embeddings,
            "qk_norm": cfg.qk_norm, "rope": cfg.rope.rope_type, "dtype": str(dtype).removeprefix("torch."),
            "weights": "random", "parameters": cfg.num_parameters()}


def _copy_gbps(device) -> float:
    import torch

    n = (1 << 30) if device.type == "cuda" else (1 << 26)
    x = torch.randint(0, 255, (n,), dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    times = [seconds(lambda: y.copy_(x), device) for _ in range(20)]
    return 2 * n / statistics.median(times[5:]) / 1e9


def _engine(cfg: ModelConfig, weights, device, backend: str):
    """The engine over `weights` (a copy of the transformers model's, fused, when transformers is installed)."""
    from warploop.llm.build import build_backend
    from warploop.llm.engine import Engine

    max_len = ENGINE_MAX_LEN
    backend, max_context = build_backend(cfg, weights, device, block_size=16, num_kv_blocks=(64 * max_len) // 16,
                                         max_num_seqs=max(BATCHES), max_model_len=max_len, backend=backend)
    return Engine(cfg, backend, None, model_name="random", max_context=max_context,
                  max_num_seqs=max(BATCHES), max_batch_tokens=4096, enable_prefix_caching=False)


def _guard(fn, *args) -> dict:
    try:
        return fn(*args)
    except Exception as e:  # one failing system must not lose the others' figures
        import traceback

        traceback.print_exc()
        return {"error": f"{type(e).__name__}: {e}"[:500]}


def _measure_engine(engine, prompts, repeats: int, steps: int, batches=BATCHES[1:], ttft: bool = True) -> dict:
    import resource

    from warploop.llm.params import SamplingParams

    params = SamplingParams(max_tokens=steps + 1, temperature=0, ignore_eos=True)
    engine.generate(prompts(1)[0].tolist(), params)  # warm-up
    cpu0, wall0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    out = {"ms_per_token_bs1": _median(repeats, lambda: engine.generate(prompts(1)[0].tolist(), params).ms_per_token)}
    cpu1, wall1 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    # host CPU time (user + system, every thread of the process) per generated token at batch 1
    cpu_s = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
    out["host_cpu_us_per_token_bs1"] = round(cpu_s / (repeats * (steps + 1)) * 1e6, 1)
    out["host_cpu_fraction_bs1"] = round(cpu_s / (wall1 - wall0), 3)
    # sampled at a temperature alone (an OpenAI request's defaults): on the device where the backend
    # draws it there (the stream's and the megakernel's loops), else sampled on the host each step
    sampled = SamplingParams(max_tokens=steps + 1, temperature=1.0, seed=0, ignore_eos=True)
    out["ms_per_token_sampled_bs1"] = _median(repeats, lambda: engine.generate(prompts(1)[0].tolist(),
                                                                               sampled).ms_per_token)
    for batch in batches:
        out[f"tok_s_bs{batch}"] = _median(repeats, lambda b=batch: _engine_tok_s(engine, prompts(b), params, steps))
    if ttft:
        two = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
        engine.generate(prompts(1, TTFT_LEN)[0].tolist(), two)
        runs = [engine.generate(prompts(1, TTFT_LEN)[0].tolist(), two) for _ in range(max(repeats, TTFT_RUNS))]
        out.update(_ttft([c.ttft_ms for c in runs]))
        # its parts: waiting for admission, the prompt's steps to the first token; then the first decode step
        out["ttft_split_ms_1024"] = {part: round(statistics.median(getattr(c, f"{part}_ms") for c in runs), 3)
                                     for part in ("queue", "prefill", "first_step")}
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


def _measure_hf(model, prompts, repeats: int, steps: int, batches=BATCHES[1:], ttft: bool = True) -> dict:
    from warploop.bench.decode_peers import hf_generate_s

    def decode_s(batch):
        # the fastest of three runs of each: a difference of two single timings went negative on
        # a loaded machine (the one-token run slower than the whole one), and a difference of the
        # fastest of two still did once on a 2-core CI machine (a tiny model's few steps are within
        # the noise): a difference that is not positive is measured again, up to five times
        p = prompts(batch)
        for _ in range(5):
            d = (min(hf_generate_s(model, p, steps + 1) for _ in range(3))
                 - min(hf_generate_s(model, p, 1) for _ in range(3)))
            if d > 0:
                break
        return d

    decode_s(1)  # warm-up
    out = {"ms_per_token_bs1": _median(repeats, lambda: decode_s(1) / steps * 1e3), "decode_steps": steps}
    for batch in batches:
        out[f"tok_s_bs{batch}"] = _median(repeats, lambda b=batch: b * steps / decode_s(b))
    if ttft:
        hf_generate_s(model, prompts(1, TTFT_LEN), 1)
        out.update(_ttft([hf_generate_s(model, prompts(1, TTFT_LEN), 1) * 1e3 for _ in range(max(repeats, TTFT_RUNS))]))
    return out


def _measure_compiled(cfg, device, dtype, prompts, repeats: int, steps: int, batches=BATCHES[1:],
                      ttft: bool = True) -> dict:
    from warploop.bench.decode_peers import CompiledDecoder, gptfast_model

    decoder = CompiledDecoder(gptfast_model(cfg, device, dtype), use_cuda_graphs=True)
    max_len = -(-(PROMPT_LEN + steps + 1) // 64) * 64
    out, compile_s = {}, {}
    for batch in (1, *batches):
        t0 = time.perf_counter()
        decoder.decode_s(prompts(batch), 8, max_len)  # compiles and records the graph for this batch size
        decoder.decode_s(prompts(batch), 8, max_len)
        compile_s[f"bs{batch}"] = round(time.perf_counter() - t0, 1)
        runs = _median(repeats, lambda b=batch: decoder.decode_s(prompts(b), steps, max_len))
        out["ms_per_token_bs1" if batch == 1 else f"tok_s_bs{batch}"] = \
            runs / steps * 1e3 if batch == 1 else batch * steps / runs
    if ttft:
        t0 = time.perf_counter()
        decoder.ttft_s(prompts(1, TTFT_LEN), TTFT_LEN + 64)
        compile_s["prefill_1024"] = round(time.perf_counter() - t0, 1)
        out.update(_ttft([decoder.ttft_s(prompts(1, TTFT_LEN), TTFT_LEN + 64) * 1e3
                          for _ in range(max(repeats, TTFT_RUNS))]))
    out["compile_s"] = compile_s
    return out


def _median(repeats: int, fn) -> float:
    return round(statistics.median(fn() for _ in range(repeats)), 3)


def _ttft(ms: list[float]) -> dict:
    """TTFT runs' median and their 10th and 90th percentiles (p90 / p10: how far one run can be trusted)."""
    deciles = statistics.quantiles(ms, n=10) if len(ms) > 1 else [ms[0]] * 9
    return {"ttft_ms_1024": round(statistics.median(ms), 3),
            "ttft_p10_p90_ms_1024": [round(deciles[0], 3), round(deciles[-1], 3)]}


def _ratios(entry: dict, batches=BATCHES[1:]) -> dict:
    """Per backend of ours: floor / ms, and each peer's figure over ours (> 1: ours is faster)."""
    def get(system, key):
        value = entry.get(system, {}).get(key)
        return value if isinstance(value, (int, float)) and value > 0 else None

    out = {}
    for ours_name in ("megakernel", "stream", "warploop"):
        ours = get(ours_name, "ms_per_token_bs1")
        if ours:
            out[f"floor_over_{ours_name}_bs1"] = round(entry["floor_ms"] / ours, 3)
            for peer in ("hf_eager", "torch_compile", "warploop", "megakernel"):
                theirs = get(peer, "ms_per_token_bs1")
                if theirs and peer != ours_name:
                    out[f"{peer}_ms_over_{ours_name}_ms_bs1"] = round(theirs / ours, 3)
        for batch in batches:
            ours = get(ours_name, f"tok_s_bs{batch}")
            for peer in ("hf_eager", "torch_compile", "warploop"):
                theirs = get(peer, f"tok_s_bs{batch}")
                if ours and theirs and peer != ours_name:
                    out[f"{ours_name}_over_{peer}_tok_s_bs{batch}"] = round(ours / theirs, 3)
        ours, theirs = get(ours_name, "ttft_ms_1024"), get("warploop", "ttft_ms_1024")
        if ours_name == "megakernel" and ours and theirs:
            out["megakernel_ttft_over_warploop_ttft"] = round(ours / theirs, 3)
    return out
