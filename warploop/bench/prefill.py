"""`warploop bench prefill`: prefill speed, and how running streams fare while a long prompt arrives.

Per model shape (random bf16 weights on a GPU; a small float32 config on the CPU):
- `prefix_L` (a GPU): the last quarter of an L-token prompt (at most 2,048 tokens) prefilled over the
  rest, cached, attending through a gathered context with a dense mask (sdpa) and from the pages in
  one Triton launch (paged), alternated in the same run; `fresh_L` the whole prompt with nothing
  cached: SDPA over the new k and v (torch's choice of backend, and flash or memory-efficient only)
  against the paged kernel reading them back; `graphs_L` (up to 4,096 tokens) the paged prefill op by
  op against its CUDA graph (cuda_graphs.PrefillGraphs).
- `prefill_tok_s_L` for each prompt length L: the engine's per-op prefill (the backend's forward of
  one L-token prompt into the paged KV cache, every layer and the logits of its last token), timed
  by CUDA events (the CPU: wall time), median of `--runs` runs with p10 and p90; beside it, in the
  same run, the gpt-fast-style peer (`torch.compile` of the same shapes, SDPA attention) prefilling
  the same length. The peer is left out on the CPU. `new_length_ms`, `new_thread_ms` and
  `new_length_by_attention`: first prefills of an unseen length, or on a new thread (_first_runs).
- `itl`: `--streams` greedy streams decode through the engine while a `--long`-token prompt
  arrives; the streams' inter-token gaps from its arrival to its first token, p50 and p99, with
  chunked prefill (`--max-prefill-tokens`) and with the prompt in one step, in the same run.
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import threading
import time

from warploop.bench.common import checkpoint, emit, header, result_path
from warploop.bench.timing import seconds
from warploop.llm.shapes import CPU_MODELS, GPU_MODELS

GPU_LENGTHS, CPU_LENGTHS = (1024, 4096, 16384), (64, 256)
GRAPH_LENGTHS = 4096        # graphs_L up to this length: past it launches are a small share of a prefill


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from warploop.args import positive_int
    parser.add_argument("--json", action="store_true", help="print only the JSON result")
    parser.add_argument("--models", default=None, help="comma-separated model shapes (default: all of " +
                        ", ".join(GPU_MODELS) + " on a GPU; small-cpu without one)")
    parser.add_argument("--lengths", default=None, help="comma-separated prompt lengths (default 1024,4096,16384 "
                        "on a GPU, 64,256 on the CPU)")
    parser.add_argument("--runs", type=positive_int, default=None, help="timed runs per figure (default 20; CPU 3)")
    parser.add_argument("--streams", type=positive_int, default=8, help="decoding streams for the itl figure")
    parser.add_argument("--long", type=positive_int, default=None,
                        help="the arriving prompt's tokens for the itl figure (default 16384; CPU 256)")
    parser.add_argument("--max-prefill-tokens", type=positive_int, default=None,
                        help="the chunk of the chunked run of the itl figure (default 2048; CPU 64)")
    parser.add_argument("--skip-peer", action="store_true", help="leave out the torch.compile peer")
    parser.add_argument("--save", default=None, help="also write the JSON here (default: bench/results/ on a GPU)")


def _ints(text: str, flag: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise SystemExit(f"bench prefill: {flag} {text!r}: give positive token counts, e.g. {flag} 1024,4096")
    return values


def _stats(times_s: list[float], tokens: int) -> dict:
    q = statistics.quantiles(times_s, n=10) if len(times_s) > 1 else [times_s[0]] * 9
    med = statistics.median(times_s)
    return {"ms": round(med * 1e3, 3), "p10_ms": round(q[0] * 1e3, 3), "p90_ms": round(q[-1] * 1e3, 3),
            "tok_s": round(tokens / med, 1), "runs": len(times_s)}


def _speedup(fast: dict, slow: dict) -> float:
    """How many times faster `fast` ran than `slow` (two _stats of the same tokens), from their tokens/s:
    the ms are rounded to the µs, which a fake backend's runs (the tests) round to 0."""
    return round(fast["tok_s"] / slow["tok_s"], 3)


def main(args: argparse.Namespace) -> int:
    import torch

    gpu = torch.cuda.is_available()
    device = torch.device("cuda" if gpu else "cpu")
    known = GPU_MODELS | CPU_MODELS
    names = [n.strip() for n in (args.models or ",".join(GPU_MODELS if gpu else CPU_MODELS)).split(",") if n.strip()]
    bad = [n for n in names if n not in known]
    if bad or not names:
        raise SystemExit(f"bench prefill: --models {args.models!r}: unknown model {', '.join(bad) or '(none)'}; "
                         f"choose from {', '.join(known)}")
    lengths = _ints(args.lengths, "--lengths") if args.lengths else (GPU_LENGTHS if gpu else CPU_LENGTHS)
    runs = args.runs or (20 if gpu else 3)
    long = args.long or (16384 if gpu else 256)
    chunk = args.max_prefill_tokens or (2048 if gpu else 64)
    say = (lambda *a: None) if args.json else (lambda *a: print(*a, flush=True))
    result = header("prefill")
    result["method"] = {
        "prefill_tok_s": "prompt tokens / device time of the per-op backend's prefill forward (CUDA events), "
                         f"median of {runs} runs, p10 and p90; the peer the same way",
        "itl": f"{args.streams} greedy streams' inter-token gaps from a {long}-token prompt's arrival to its "
               f"first token, p50 and p99, chunked (max_prefill_tokens {chunk}) and in one step"}
    result["models"] = {}
    save = args.save or (result_path("prefill") if gpu else None)
    for name in names:
        title, cfg = known[name]
        say(f"== {name}")
        dtype = torch.bfloat16 if gpu else torch.float32
        entry = result["models"][name] = {"model": title, "dtype": str(dtype).removeprefix("torch.")}
        entry["warploop"] = _prefill_engine(cfg, device, dtype, lengths, runs, say)
        if gpu and not args.skip_peer:
            entry["torch_compile"] = _prefill_peer(cfg, device, dtype, lengths, runs, say)
            for n in lengths:
                ours, theirs = entry["warploop"].get(str(n), {}), entry["torch_compile"].get(str(n), {})
                if "tok_s" in ours and "tok_s" in theirs:
                    entry[f"prefill_over_torch_compile_{n}"] = round(ours["tok_s"] / theirs["tok_s"], 3)
        entry["itl"] = _itl(cfg, device, dtype, args.streams, long, chunk, say)
        torch.cuda.empty_cache() if gpu else None
        checkpoint(result, save)
    emit(result, save)
    return 0


def _backend(cfg, device, dtype, tokens: int, seqs: int = 1):
    from warploop.llm.build import build_backend
    from warploop.llm.weights import random_weights
    weights = random_weights(cfg, device, dtype)
    blocks = seqs * (-(-tokens // 16) + 2)
    return build_backend(cfg, weights, device, block_size=16, num_kv_blocks=blocks, max_num_seqs=seqs,
                         max_model_len=min(cfg.max_position_embeddings, tokens + 64), backend="torch")


def _prefill_engine(cfg, device, dtype, lengths, runs, say) -> dict:
    import torch

    out = {}
    backend, _ = _backend(cfg, device, dtype, max(lengths))
    gen = torch.Generator().manual_seed(0)
    for n in lengths:
        if n > cfg.max_position_embeddings:
            out[str(n)] = {"error": f"longer than the model's {cfg.max_position_embeddings} positions"}
            continue
        ids = torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist()
        batch = _prompt(ids)
        with torch.no_grad():
            backend.forward(batch)                 # warm-up: allocations, kernels' first use
            times = [seconds(lambda b=batch: backend.forward(b), device) for _ in range(runs)]
        out[str(n)] = _stats(times, n) | _first_runs(backend, ids, device)
        say(f"  warploop prefill {n}: {out[str(n)]['ms']} ms, {out[str(n)]['tok_s']} tok/s, "
            f"{out[str(n)]['new_length_ms']} ms at a new length, {out[str(n)]['new_thread_ms']} on a new thread")
        if backend.use_triton:
            out[f"prefix_{n}"] = _prefix(backend, ids, runs, device, say)
            out[f"fresh_{n}"] = _fresh(backend, ids, runs, device, say)
            if n <= GRAPH_LENGTHS:
                out[f"graphs_{n}"] = _graphs(backend, ids, runs, device, say)
    return out


def _prompt(ids: list[int]):
    """One fresh prompt of `ids` in blocks 0, 1, ... of 16 tokens (the bench backends' block size)."""
    from warploop.llm.backend import ModelBatch
    n = len(ids)
    return ModelBatch(ids, list(range(n)), [n], [n], [list(range(-(-n // 16)))])


def _first_runs(backend, ids: list[int], device) -> dict:
    """ms of first prefills, which the warm figures never see: `new_length_ms`, a length the backend
    has not run (3 tokens fewer) on this thread; `new_thread_ms`, the warm length on a thread of its
    own (the engine's loop runs on one); `new_length_by_attention`, an unseen length each (4, 5, ...
    fewer) under each fresh-prompt attention of _FRESH: what a request of a new prompt length pays where
    a library builds something per shape."""
    import torch


    def first(n: int, thread: bool = False) -> float:
        batch = _prompt(ids[:n])
        took = []

        def run() -> None:
            with torch.no_grad():
                took.append(seconds(lambda: backend.forward(batch), device))
        if thread:
            t = threading.Thread(target=run)
            t.start()
            t.join()
        else:
            run()
        return round(took[0] * 1e3, 3)

    n = len(ids)
    out = {"new_length_ms": first(n - 3), "new_thread_ms": first(n, thread=True)}
    if backend.use_triton:
        by = {}
        for k, (name, choice) in enumerate(_FRESH.items()):
            with _attention(backend, choice):
                by[name] = first(n - 4 - k)
        out["new_length_by_attention"] = by
    return out


def _prefix(backend, ids: list[int], runs: int, device, say) -> dict:
    """The last quarter of a prompt (at most 2,048 tokens) prefilled over the rest, cached (a chunk
    after the first, a prefix hit): a gathered context and a dense mask a sequence (sdpa) against
    one launch attending from the pages (paged, TorchBackend.paged_prefill "prefix", the GPU's default)."""
    import torch

    from warploop.llm.backend import ModelBatch
    n = len(ids)
    new = max(1, min(2048, n // 4))
    blocks = list(range(-(-n // 16)))
    with torch.no_grad():
        backend.forward(ModelBatch(ids[:n - new], list(range(n - new)), [n - new], [n - new], [blocks]))
    batch = ModelBatch(ids[n - new:], list(range(n - new, n)), [new], [n], [blocks])
    modes = {"sdpa": {"paged_prefill": "off"}, "paged": {"paged_prefill": "prefix"}}
    rec = {"new_tokens": new, "context": n} | _alternate(backend, batch, runs, device, modes)
    rec["paged_over_sdpa"] = _speedup(rec["paged"], rec["sdpa"])
    say(f"  prefix {new} over {n - new}: sdpa {rec['sdpa']['ms']} ms, paged {rec['paged']['ms']} ms")
    return rec


# a fresh prompt's attentions, as _attention sets them
_FRESH = {"sdpa": {"paged_prefill": "prefix"},
          "sdpa_flash": {"paged_prefill": "prefix", "sdpa_backends": ("FLASH_ATTENTION", "EFFICIENT_ATTENTION")},
          "paged": {"paged_prefill": "all"}}


@contextlib.contextmanager
def _attention(backend, choice: dict):
    """The backend runs as `choice` inside the block: its attributes (paged_prefill, prefill_graphs)
    and sdpa_backends (layers.SDPA_BACKENDS, None unless given), all restored after."""
    from warploop.llm import layers
    attrs = {k: v for k, v in choice.items() if k != "sdpa_backends"}
    before = {k: getattr(backend, k) for k in attrs}, layers.SDPA_BACKENDS
    for k, v in attrs.items():
        setattr(backend, k, v)
    layers.SDPA_BACKENDS = choice.get("sdpa_backends")
    try:
        yield
    finally:
        for k, v in before[0].items():
            setattr(backend, k, v)
        layers.SDPA_BACKENDS = before[1]


def _fresh(backend, ids: list[int], runs: int, device, say) -> dict:
    """A fresh prompt's prefill attending with SDPA over its new k and v (sdpa: the default, torch's
    choice of SDPA backend; sdpa_flash: flash or memory-efficient only) against the paged kernel
    reading them back from the pages they were just written to (paged: paged_prefill "all")."""
    n = len(ids)
    batch = _prompt(ids)
    rec = _alternate(backend, batch, runs, device, _FRESH)
    rec["paged_over_sdpa"] = _speedup(rec["paged"], rec["sdpa"])
    say(f"  fresh {n}: " + ", ".join(f"{k} {rec[k]['ms']} ms" for k in _FRESH))
    return rec


def _graphs(backend, ids: list[int], runs: int, device, say) -> dict:
    """A fresh prompt's prefill from the pages op by op (eager) against a CUDA graph replay of it
    (cuda_graphs.PrefillGraphs, WARPLOOP_PREFILL_GRAPHS), alternated: what launches cost; capture_ms, the
    first graphed prefill's wall time, which captures its bucket's graph (what a server's first prompt of
    that bucket pays)."""
    import torch

    from warploop.llm.cuda_graphs import PrefillGraphs
    n = len(ids)
    batch = _prompt(ids)
    graphs = PrefillGraphs(backend, n)
    try:
        with _attention(backend, {"paged_prefill": "all", "prefill_graphs": graphs}), torch.no_grad():
            t0 = time.perf_counter()          # wall time: the capture runs on a stream of its own
            backend.forward(batch)
            torch.cuda.synchronize(device) if device.type == "cuda" else None
            capture_ms = round((time.perf_counter() - t0) * 1e3, 3)
        rec = _alternate(backend, batch, runs, device, {"eager": {"paged_prefill": "all", "prefill_graphs": None},
                                                        "graphs": {"paged_prefill": "all", "prefill_graphs": graphs}})
    finally:
        graphs.release()
    rec["graphs_over_eager"] = _speedup(rec["graphs"], rec["eager"])
    rec["capture_ms"] = capture_ms
    say(f"  graphs {n}: eager {rec['eager']['ms']} ms, graphs {rec['graphs']['ms']} ms, capture {capture_ms} ms")
    return rec


def _alternate(backend, batch, runs: int, device, modes: dict[str, dict]) -> dict:
    """Each of `modes` (name: _attention's choice) on one batch, alternated run by run after a
    warm-up of each: {name: stats}; the backend's own choice restored after."""
    import torch

    tokens = sum(batch.query_lens)
    times = {name: [] for name in modes}
    with torch.no_grad():
        for choice in modes.values():              # warm-up: each path's first use
            with _attention(backend, choice):
                backend.forward(batch)
        for _ in range(runs):
            for name, choice in modes.items():
                with _attention(backend, choice):
                    times[name].append(seconds(lambda: backend.forward(batch), device))
    return {k: _stats(v, tokens) for k, v in times.items()}


def _prefill_peer(cfg, device, dtype, lengths, runs, say) -> dict:
    import torch

    from warploop.bench.decode_peers import CompiledDecoder, gptfast_model
    out = {}
    try:
        model = gptfast_model(cfg, device, dtype)
        dec = CompiledDecoder(model, use_cuda_graphs=False)
    except Exception as e:  # the peer failing must not lose our figures
        return {"error": f"{type(e).__name__}: {e}"[:300]}
    for n in lengths:
        prompt = torch.randint(0, cfg.vocab_size, (1, n), device=device)
        try:
            with torch.no_grad():
                model.setup_caches(1, n)
                positions = torch.arange(n, device=device)
                dec.prefill(prompt, positions)      # compile
                times = [seconds(lambda p=prompt, at=positions: dec.prefill(p, at), device) for _ in range(runs)]
            out[str(n)] = _stats(times, n)
            say(f"  torch.compile prefill {n}: {out[str(n)]['ms']} ms")
        except Exception as e:
            out[str(n)] = {"error": f"{type(e).__name__}: {e}"[:300]}
    return out


def _itl(cfg, device, dtype, streams: int, long: int, chunk: int, say) -> dict:
    """p50 / p99 inter-token gaps of `streams` decoding streams while a `long`-token prompt is
    admitted, chunked and in one step."""
    import torch

    from warploop.llm.engine import Engine, SamplingParams
    out = {}
    gen = torch.Generator().manual_seed(1)
    long = min(long, cfg.max_position_embeddings - 64)     # SmolLM2-135M has 8,192 positions: its own longest
    for label, max_prefill in (("chunked", chunk), ("one_step", long + 1)):
        backend, max_context = _backend(cfg, device, dtype, long + 512, seqs=streams + 1)
        with Engine(cfg, backend, None, max_context=max_context, max_num_seqs=streams + 1, max_batch_tokens=long + 1,
                    enable_prefix_caching=False, max_prefill_tokens=max_prefill) as engine:
            stamps: dict[str, list[float]] = {}
            arrived, first, done = [0.0], threading.Event(), threading.Semaphore(0)
            lock = threading.Lock()

            def on(name, stamps=stamps, lock=lock, first=first, done=done):
                def cb(event):
                    if event.error is not None:
                        first.set()
                        done.release()
                        return
                    with lock:
                        stamps.setdefault(name, []).append(time.perf_counter())
                    if name == "long" and event.token_id is not None:
                        first.set()
                    if event.finish_reason is not None:
                        done.release()
                return cb

            stream = SamplingParams(max_tokens=max_context - 32, temperature=0.0, ignore_eos=True)
            for i in range(streams):
                prompt = torch.randint(0, cfg.vocab_size, (16,), generator=gen).tolist()
                engine.add_request(prompt, stream, on(f"s{i}"), request_id=f"s{i}")
            time.sleep(0.5 if device.type == "cuda" else 2.0)      # the streams are decoding
            arrived[0] = time.perf_counter()
            engine.add_request(torch.randint(0, cfg.vocab_size, (long,), generator=gen).tolist(),
                               SamplingParams(max_tokens=1, temperature=0.0), on("long"), request_id="long")
            first.wait(600)
            end = time.perf_counter()
            time.sleep(0.2 if device.type == "cuda" else 2.0)      # each stream's first token after it
            for i in range(streams):
                engine.abort(f"s{i}")
            for _ in range(streams + 1):
                done.acquire(timeout=60)
            chunks = engine.stats()["prefill_chunks"]
        gaps = []
        for name, ts in stamps.items():
            if name != "long":
                # the last token before the prompt arrived, those while it was admitted, and the first
                # after its first token: in one step, the gap across the whole prefill is that last one
                inside = [t for t in ts if arrived[0] <= t <= end]
                before = [t for t in ts if t < arrived[0]]
                after = [t for t in ts if t > end]
                seq = before[-1:] + inside + after[:1]
                gaps += [(b - a) * 1e3 for a, b in zip(seq, seq[1:], strict=False)]
        rec = {"long_tokens": long, "prefill_chunks": chunks, "long_ttft_ms": round((end - arrived[0]) * 1e3, 2),
               "gaps": len(gaps)}
        if gaps:
            q = statistics.quantiles(gaps, n=100) if len(gaps) > 1 else [gaps[0]] * 99
            rec |= {"p50_ms": round(statistics.median(gaps), 3), "p99_ms": round(q[98], 3),
                    "max_ms": round(max(gaps), 3), "p99_over_p50": round(q[98] / max(statistics.median(gaps), 1e-9), 2)}
        out[label] = rec
        say(f"  itl {label}: {rec}")
    return out
