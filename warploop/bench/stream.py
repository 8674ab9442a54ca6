"""`warploop bench stream`: the streaming executor (warploop/runtime/stream) on a Hopper GPU.

For each model shape: a decode step's weight stream (every projection with its fused norm and
epilogue, then lm_head; bench/stream_chain.py) checked against the CPU reference's math, timed
against the same ops in PyTorch in one CUDA graph and against the floor (weight bytes over the
measured copy rate); then the same step with attention (ATTN nodes over a paged KV cache) at each
of --contexts, against a floor that counts the KV bytes. Then the cost of one dependent stage: a
chain of one-chunk GEMVs, within one CTA and alternating between two.

    warploop bench stream --json --out bench/results/stream-h200-20261128.json
"""
from __future__ import annotations

import argparse
import sys

from warploop.bench.common import emit, header


def parse_configs(text: str) -> list[tuple[int, int, int]]:
    """RINGxROWSxBK, comma-separated."""
    out = []
    for c in text.split(","):
        try:
            v = tuple(int(p) for p in c.split("x"))
            if len(v) != 3:
                raise ValueError
        except ValueError:
            raise argparse.ArgumentTypeError(f"{c!r} is not RINGxROWSxBK (e.g. 8x32x256)") from None
        out.append(v)
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from warploop.llm.shapes import GPU_MODELS
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--out", default=None, help="also write the JSON to this file")
    parser.add_argument("--models", default=",".join(GPU_MODELS),
                        help=f"comma-separated model shapes (default: all of {', '.join(GPU_MODELS)})")
    parser.add_argument("--configs", type=parse_configs, default=parse_configs("8x32x256"),
                        help="comma-separated kernel shapes RINGxROWSxBK: ring slots, tile rows, chunk width "
                             "(default 8x32x256; the first is the one checked in full)")
    parser.add_argument("--contexts", default="512,4096",
                        help="comma-separated context lengths: the step again with attention over that many tokens "
                             "(ATTN nodes, floor counting the KV bytes; default 512,4096; empty: none)")
    parser.add_argument("--runs", type=int, default=30, help="timed runs per measurement (median; default 30)")
    parser.add_argument("--stages", type=int, default=512, help="dependent stages in the latency chain (default 512)")


def time_ms(fn, runs: int, after=None) -> float:
    """Median of per-run CUDA-event times; a leading GPU sleep keeps the queue ahead of the CPU."""
    import torch
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(runs)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(runs)]
    torch.cuda._sleep(50_000_000)
    for s, e in zip(starts, ends, strict=True):
        s.record()
        fn()
        e.record()
    (after or torch.cuda.synchronize)()
    t = sorted(s.elapsed_time(e) for s, e in zip(starts, ends, strict=True))
    return t[len(t) // 2]


def copy_rate() -> float:
    """Bytes read plus written per second by a 1 GiB device copy."""
    import torch
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    ms = time_ms(lambda: dst.copy_(src), 10)
    return 2 * (1 << 30) / (ms / 1e3)


def kmax_for(chain_widths) -> int:
    k = 256
    while k < max(chain_widths):
        k *= 2
    return k


def measure_model(name, model, configs, runs, rate) -> dict:
    import torch

    from warploop.bench.stream_chain import layer_chain
    from warploop.runtime.stream.compiled import StreamConfig, compile_for, report
    from warploop.runtime.stream.executor import StreamExecutor
    from warploop.runtime.stream.reference import first_difference, reference
    widths = (model.hidden_size, model.num_heads * model.head_dim, model.intermediate_size)
    out = {"configs": []}
    for n, (ring, br, bk) in enumerate(configs):
        cfg = StreamConfig(block_rows=br, block_k=bk, ring=ring, kmax=kmax_for(widths))
        rec = {"ring": ring, "block_rows": br, "block_k": bk}
        out["configs"].append(rec)
        chain = layer_chain(model, cfg, device="cuda")
        ex = StreamExecutor(chain.program)
        rec.update(report(compile_for(cfg)))
        rec.pop("ptx", None)
        ex.run()
        if n == 0:                                  # the full check once per model
            want = reference(chain.program, chain.program.arena("cuda"))
            rec["check"] = first_difference(chain.program, ex.arena, want, rtol=2e-3) or "ok"
            lo = chain.view(ex.arena, "logits")
            ref = chain.view(want, "logits")
            rec["logits_rel_err"] = ((lo - ref).abs().max() / ref.abs().max()).item()
            out.update(weight_bytes=chain.weight_bytes, nodes=len(chain.program.nodes),
                       floor_ms=chain.weight_bytes / rate * 1e3)
            step = chain.peer()
            res0 = chain.view(chain.program.arena("cuda"), "res").to(torch.bfloat16)
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                step(res0)
            torch.cuda.current_stream().wait_stream(s)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                peer_logits = step(res0)
            graph.replay()
            torch.cuda.synchronize()
            out["peer_torch_graph_ms"] = time_ms(graph.replay, runs)
            out["peer_logits_rel_err"] = ((peer_logits.float() - ref).abs().max() / ref.abs().max()).item()
            del graph
        rec["ms"] = time_ms(ex.launch, runs, after=ex.wait)
        rec["pct_of_floor"] = 100 * out["floor_ms"] / rec["ms"]
        rec["vs_peer"] = out["peer_torch_graph_ms"] / rec["ms"]
        print(f"{name} {ring}x{br}x{bk}: {rec['ms']:.3f} ms, {rec['pct_of_floor']:.1f}% of the floor, "
              f"{rec['vs_peer']:.2f}x the torch graph", file=sys.stderr, flush=True)
        del ex, chain
        torch.cuda.empty_cache()
    return out


def measure_attention(model, contexts, runs, rate) -> dict:
    """The step with attention at each context (the first config's kernel shape, 8x32x256x4)."""
    from warploop.bench.stream_chain import layer_chain
    from warploop.llm.stream_step import attention_splits, stream_config
    from warploop.runtime.stream.executor import StreamExecutor
    from warploop.runtime.stream.reference import first_difference, reference
    cfg = stream_config(model)
    out = {}
    for ctx in contexts:
        splits = attention_splits(model, cfg, ctx)
        chain = layer_chain(model, cfg, device="cuda", context=ctx, splits=splits)
        ex = StreamExecutor(chain.program)
        start, kv0 = chain.program.arena("cuda"), chain.program.kv.clone()
        ex.run()
        want = reference(chain.program, start, kv=kv0)
        rec = {"check": first_difference(chain.program, ex.arena, want, rtol=5e-3) or "ok", "splits": splits,
               "bytes": chain.weight_bytes, "floor_ms": chain.weight_bytes / rate * 1e3}
        rec["ms"] = time_ms(ex.launch, runs, after=ex.wait)
        rec["pct_of_floor"] = 100 * rec["floor_ms"] / rec["ms"]
        out[str(ctx)] = rec
        print(f"  attention at {ctx}: {rec['ms']:.3f} ms, {rec['pct_of_floor']:.1f}% of the floor "
              f"(weights + KV), check {rec['check']}", file=sys.stderr, flush=True)
        del ex, chain
    return out


def measure_stages(stages: int, runs: int) -> dict:
    from warploop.bench.stream_chain import stage_chain
    from warploop.runtime.stream.compiled import StreamConfig
    from warploop.runtime.stream.executor import StreamExecutor
    from warploop.runtime.stream.reference import first_difference, reference
    cfg = StreamConfig(kmax=256)
    out = {"stages": stages}
    for cross in (False, True):
        p = stage_chain(cfg, stages, cross, device="cuda")
        ex = StreamExecutor(p)
        ex.run()
        check = first_difference(p, ex.arena, reference(p, p.arena("cuda")), rtol=1e-3) or "ok"
        ms = time_ms(ex.launch, runs, after=ex.wait)
        one = time_ms(StreamExecutor(stage_chain(cfg, 1, False, device="cuda")).launch, runs)
        key = "cross_cta" if cross else "same_cta"
        out[key] = {"us_per_stage": (ms - one) * 1e3 / (stages - 1), "run_ms": ms, "one_stage_run_ms": one,
                    "check": check}
    return out


def main(args) -> int:
    import torch
    if args.runs < 3 or args.stages < 2:
        raise SystemExit("--runs must be at least 3 and --stages at least 2")
    try:
        if any(int(c) < 1 for c in args.contexts.split(",") if c):
            raise ValueError
    except ValueError:
        raise SystemExit(f"--contexts: {args.contexts!r} is not a comma-separated list of positive token counts") \
            from None
    from warploop.llm.shapes import GPU_MODELS
    names = [m for m in args.models.split(",") if m]
    unknown = [m for m in names if m not in GPU_MODELS]
    if unknown:
        raise SystemExit(f"--models: unknown {unknown}; choose from {', '.join(GPU_MODELS)}")
    result = header("stream")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        result["skipped"] = "the streaming executor needs a Hopper GPU (compute capability 9.x)"
        emit(result, args.out)
        return 0
    rate = copy_rate()
    result["copy_read_plus_write_GBps"] = rate / 1e9
    result["floor_definition"] = "weight bytes / (bytes read + written per second by a 1 GiB device copy)"
    result["stage_latency"] = measure_stages(args.stages, args.runs)
    print("stages:", result["stage_latency"], file=sys.stderr, flush=True)
    contexts = [int(c) for c in args.contexts.split(",") if c]
    result["models"] = {}
    for m in names:
        result["models"][m] = measure_model(m, GPU_MODELS[m][1], args.configs, args.runs, rate)
        if contexts:
            result["models"][m]["with_attention"] = measure_attention(GPU_MODELS[m][1], contexts, args.runs, rate)
    emit(result, args.out)
    return 0
