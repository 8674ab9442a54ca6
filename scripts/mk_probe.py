"""Where a decode megakernel step's time goes, on a GPU (random bf16 weights of a model's shapes).

    PYTHONPATH=$PWD python scripts/mk_probe.py --model llama-3.2-1b --batch 1 8 --trace OUT_DIR [--plan '{"bn": 16}']
    # A/B in one process: several plans, timed in turn (list one twice to see the drift)
    PYTHONPATH=$PWD python scripts/mk_probe.py --plan '{"fused_upto":0}' '{}' '{"fused_upto":0}' '{}'

Per batch: the device time of one step (a graph replayed `--repeat` times, the runtime's own
clock), the host's full `decode()` (step inputs, copy, run, wait, logits), and the host-only
parts, and the step's logits against the per-op backend's (max relative error, argmax per row).
With --trace, a second runtime records one step (batch --trace-batch); the Perfetto trace is written to
OUT_DIR and summarised per task kind (busy time summed over workers, count, mean) and per layer.
One JSON object is printed.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import time

import torch

from warploop.llm.backend import ModelBatch
from warploop.llm.kv_cache import KVCacheLayout
from warploop.llm.mk.backend import MegakernelBackend
from warploop.llm.mk.layout import StepInputs
from warploop.llm.shapes import CPU_MODELS, GPU_MODELS
from warploop.llm.weights import random_weights

PROMPT, MAX_CONTEXT, BLOCK = 32, 2048, 16


def make(cfg, plan: dict, batches, trace: bool):
    w = random_weights(cfg, "cuda", torch.bfloat16)
    layout = KVCacheLayout(cfg.num_layers, (max(batches) + 1) * MAX_CONTEXT // BLOCK, BLOCK, cfg.num_kv_heads,
                           cfg.head_dim, "bfloat16")
    t0 = time.perf_counter()
    # every batch on the graph unless the plan says otherwise (the backend's default runs batches per op)
    mk = MegakernelBackend(cfg, w, layout, "cuda", MAX_CONTEXT, trace=trace, **{"graph_rows": 0, **plan})
    mk.warmup(max(batches))
    return mk, time.perf_counter() - t0


def prefill(mk, n: int, prompt: int = PROMPT):
    tables = [list(range(i * MAX_CONTEXT // BLOCK, (i + 1) * MAX_CONTEXT // BLOCK)) for i in range(n)]
    prompts = [[(7 * i + j) % 1000 + 1 for j in range(prompt)] for i in range(n)]
    for i, p in enumerate(prompts):       # one sequence at a time: long prompts at large batches fit
        mk.forward(ModelBatch(p, list(range(prompt)), [prompt], [prompt], [tables[i]]))
    return ModelBatch([5] * n, [prompt] * n, [1] * n, [prompt + 1] * n, tables)


def timing(mk, n: int, repeat: int, prompt: int) -> dict:
    batch = prefill(mk, n, prompt)
    mk.decode(batch)
    dg = mk.last
    device = []
    for _ in range(5):
        f = dg.graph.launch(repeat=repeat)
        f.result(timeout=60)
        device.append(f.device_ns / 1e3 / repeat)
    host = []
    backend = dg.graph.runtime._backend  # noqa: SLF001 (the kernel of this batch's graph)
    relaunched = getattr(backend, "relaunches", 0)
    for _ in range(50):
        t0 = time.perf_counter()
        mk.decode(batch)
        host.append((time.perf_counter() - t0) * 1e6)
    relaunched = getattr(backend, "relaunches", 0) - relaunched
    run = []
    for _ in range(50):
        t0 = time.perf_counter()
        dg.graph.run(timeout=60)
        run.append((time.perf_counter() - t0) * 1e6)
    ser = []
    for _ in range(50):
        t0 = time.perf_counter()
        StepInputs(dg.batch, dg.width, tuple(batch.token_ids), tuple(batch.positions), tuple(batch.context_lens),
                   tuple(batch.slot_mapping(BLOCK).tolist()), tuple(tuple(t) for t in batch.block_tables), (), (),
                   dg.history_width).serialize()
        ser.append((time.perf_counter() - t0) * 1e6)
    # the graph's logits against the per-op backend's for the same step (both write the same KV slot)
    got = mk.forward(batch).float().clone()
    want = mk.per_op.forward(batch).float()
    check = {"rel_err": float((got - want).abs().max() / want.abs().max()),
             "argmax_equal": f"{int((got.argmax(-1) == want.argmax(-1)).sum())}/{n}"}
    med = statistics.median
    return {"device_us_per_step": round(med(device), 1), "vs_per_op": check,
            "device_runs_us": [round(x, 1) for x in device],
            "graph_run_wall_us": round(med(run), 1), "decode_wall_us": round(med(host), 1),
            "step_inputs_us": round(med(ser), 1), "relaunches_in_50_decodes": relaunched,
            "last_resume_us": round(getattr(backend, "last_resume_us", 0.0), 1),
            "nodes": len(dg.graph), "kinds": dict(dg.kinds)}


def switching(mk, n: int, prompt: int, turns: int = 20) -> dict:
    """Host wall time of a batch-1 step and a batch-n step in turn, where they run on two resident
    kernels (batch1_kernel): each step parks the other kernel and relaunches its own."""
    one, many = prefill(mk, 1, prompt), prefill(mk, n, prompt)
    walls = []
    for _ in range(turns):
        for batch in (one, many):
            t0 = time.perf_counter()
            mk.decode(batch, logits=False)
            walls.append((time.perf_counter() - t0) * 1e6)
    return {"batches": [1, n], "step_wall_us_median": round(statistics.median(walls), 1),
            "relaunches": [rt._backend.relaunches for rt in mk.runtimes]}  # noqa: SLF001


def anatomy(mk, out_dir: str, n: int, prompt: int) -> dict:
    batch = prefill(mk, n, prompt)
    for _ in range(3):
        mk.decode(batch)
    rt = mk.graph_for(n, prompt + 1).graph.runtime
    rt._backend.trace_events()  # noqa: SLF001 (drain: the newest events are the last step's)
    mk.decode(batch)
    events = rt._backend.trace_events()  # noqa: SLF001
    path = os.path.join(out_dir, "mk-step-trace.json")
    rt.save_trace(path)
    names = rt.names
    dg = mk.last
    # the last step's events: the graph's node count per worker is known; keep the newest per worker
    last = sorted(events)[-len(dg.graph):]
    t0, t1 = min(e[0] for e in last), max(e[1] for e in last)
    kinds = collections.defaultdict(lambda: [0, 0])
    for start, end, opcode, _worker, ident in last:
        k = dg.labels[ident] if 0 <= ident < len(dg.labels) else names.get(opcode, str(opcode))
        kinds[k][0] += end - start
        kinds[k][1] += 1
    workers = len({e[3] for e in last})
    busy = sum(e[1] - e[0] for e in last)
    # per kind: the wall span from its first start to its last end, summed over layers is not
    # separable here; report busy (sum over workers) / workers as the average per worker
    return {"step_span_us": round((t1 - t0) / 1e3, 1), "workers": workers,
            "busy_fraction": round(busy / (workers * (t1 - t0)), 3),
            "per_kind": {k: {"count": c, "busy_us_total": round(b / 1e3, 1), "mean_us": round(b / c / 1e3, 2),
                             "avg_per_worker_us": round(b / workers / 1e3, 1)}
                         for k, (b, c) in sorted(kinds.items(), key=lambda kv: -kv[1][0])},
            "trace": path}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama-3.2-1b", choices=list(GPU_MODELS) + list(CPU_MODELS))
    parser.add_argument("--batch", type=int, nargs="*", default=[1], help="batches to time (none: only --trace)")
    parser.add_argument("--plan", nargs="+", default=["{}"],
                        help="Plan overrides as JSON, e.g. '{\"bn\": 32}'; several: each timed in turn (keys p0_, "
                             "p1_, ...; --trace and --compile-only take the first)")
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--trace", default=None, help="also record one step into this folder (batch --trace-batch)")
    parser.add_argument("--trace-batch", type=int, default=1, help="the batch of the traced step (default 1)")
    parser.add_argument("--context", type=int, nargs="+", default=[PROMPT],
                        help=f"tokens of context before the timed step, per sequence (default {PROMPT}, most "
                             f"{MAX_CONTEXT - 64}); several: each batch at each")
    parser.add_argument("--compile-only", action="store_true",
                        help="only compile the resident kernel into Triton's cache (no launch: run several at once); "
                             "with --trace, its traced variant")
    args = parser.parse_args()
    cfg = (GPU_MODELS | CPU_MODELS)[args.model][1]
    plans = [json.loads(p) for p in args.plan]
    plan = plans[0]
    if not all(1 <= c <= MAX_CONTEXT - 64 for c in args.context):
        parser.error(f"--context must be 1 .. {MAX_CONTEXT - 64}, got {args.context}")
    if args.compile_only:
        from mk_resources import compile_kernel, plans_of  # scripts/: beside this file

        t0 = time.perf_counter()
        # with --trace the traced kernels only (run a plain one beside it)
        plans, warps, regs = plans_of(cfg, plan)
        for compiled_plan in plans:
            compile_kernel(compiled_plan, None, warps, trace=bool(args.trace), max_registers=regs)
        print(json.dumps({"compiled": args.plan[0], "s": round(time.perf_counter() - t0, 1)}))
        return
    out = {"model": args.model, "context": args.context}
    for i, p in enumerate(plans if args.batch else []):
        prefix = f"p{i}_" if len(plans) > 1 else ""
        mk, start_s = make(cfg, p, args.batch, False)
        out.update({f"{prefix}plan": str(mk.plan), f"{prefix}plan_many": str(mk.plan_many),
                    f"{prefix}options": p, "workers": mk.rt.workers,
                    f"{prefix}start_s": round(start_s, 1), "per_sm": getattr(mk.rt._backend, "per_sm", None)})  # noqa: SLF001
        try:
            for n in args.batch:
                for c in args.context:
                    key = prefix + (f"bs{n}" if len(args.context) == 1 else f"bs{n}_ctx{c}")
                    out[key] = timing(mk, n, args.repeat, c)
                    out[key]["attention"] = "fused" if "rope_attn" in out[key]["kinds"] else "split"
                    print(json.dumps({key: out[key]["device_us_per_step"], "attention": out[key]["attention"],
                                      "vs_per_op": out[key]["vs_per_op"],
                                      "nodes": out[key]["nodes"], "options": p}), flush=True)
            many = [n for n in args.batch if n > 1]
            if len(mk.runtimes) > 1 and 1 in args.batch and many:
                out[prefix + "switching"] = switching(mk, many[0], args.context[0])
                print(json.dumps({prefix + "switching": out[prefix + "switching"]}), flush=True)
        finally:
            mk.close()
    if args.trace:
        os.makedirs(args.trace, exist_ok=True)
        mk, s = make(cfg, plan, [args.trace_batch], True)
        out["trace_start_s"] = round(s, 1)
        try:
            out[f"anatomy_bs{args.trace_batch}"] = anatomy(mk, args.trace, args.trace_batch, args.context[0])
        finally:
            mk.close()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
