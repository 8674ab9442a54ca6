"""Time a model's decode step on the streaming executor (warploop/llm/stream_step.py): random bf16
weights of the exact shapes, one token at position CONTEXT - 1 (the cache's earlier tokens are
zeros: the bytes read are the same), the kernel alone (CUDA events, median), the host-driven step
(token and step words written, launch, wait), and the decode loop: `--loop` greedy steps in one
launch (StreamDecoder.generate), per token; with --batch, B rows a step, each over blocks of its
own (tokens_per_s). The kernel is timed ROUNDS times (RUNS launches each); the median of the rounds
is reported. Prints one JSON object.

    PYTHONPATH=. python scripts/stream_step_time.py --model llama-3.2-1b --context 512
"""
import argparse
import dataclasses
import json
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent))   # bench_tp.py: Llama-3.1-8B's shapes
from bench_tp import LLAMA_3_1_8B  # noqa: E402

from warploop.bench.stream import copy_rate, time_ms
from warploop.llm.shapes import GPU_MODELS
from warploop.llm.stream_step import StreamDecoder, batch_rows, stream_config
from warploop.llm.weights import random_weights

ROUNDS = 5
MODELS = {name: cfg for name, (_, cfg) in GPU_MODELS.items()} | {"llama-3.1-8b": LLAMA_3_1_8B}


def anatomy(ex) -> dict:
    """Per kind of node (GEMVs told apart by their input width and rows), from the kernel's stamps of
    its last launch: instructions, and µs summed over them and averaged over CTAs (waiting, met wait
    to first chunk, first chunk to published, the loader's wait for free slots; loader_late: from the
    met wait to the loader taking the first chunk's slot, where it took it after the wait, n_late such
    nodes; data_wait: the consumer's wait for its later chunks to land, part of to_published), the
    median instruction's stream time, the span."""
    stamps = ex.trace.cpu().numpy().astype("int64")
    insts = ex.built.instructions
    t0 = stamps[:, 0][stamps[:, 0] > 0].min()
    s = (stamps - t0) / 1e3
    kinds = {}
    for j, inst in enumerate(insts):
        if stamps[j, 0] <= 0:
            continue
        f = inst.fields
        key = inst.kind.name + (f"/k{f.get('k')}x{f.get('batch', 1)}" if inst.kind.name == "gemv" else "")
        d = kinds.setdefault(key, {"n": 0, "wait": 0.0, "to_first": 0.0, "to_published": 0.0, "loader_blocked": 0.0,
                                   "loader_late": 0.0, "n_late": 0, "data_wait": 0.0, "pub": []})
        d["n"] += 1
        if stamps[j, 4] > 0 and stamps[j, 4] > stamps[j, 1]:   # the loader took the first chunk's slot after the
            d["loader_late"] += s[j, 4] - s[j, 1]             # wait was met: its copy on the critical path
            d["n_late"] += 1
        d["loader_blocked"] += stamps[j, 5] / 1e3
        d["data_wait"] += stamps[j, 6] / 1e3
        d["wait"] += s[j, 1] - s[j, 0]
        # a node with no chunk (an attention share past the context) stamps no first chunk this launch:
        # its time after the wait counts as "to published"
        first = s[j, 2] if stamps[j, 2] >= stamps[j, 1] else s[j, 1]
        d["to_first"] += first - s[j, 1]
        d["to_published"] += s[j, 3] - first
        d["pub"].append(s[j, 3] - first)
    return {"span_us": round(float(s[:, 3].max()), 1), "ctas": ex.ctas,
            "kinds": {k: {"n": d["n"], "n_late": d["n_late"], **{p: round(d[p] / ex.ctas, 1) for p in
                                                             ("wait", "to_first", "to_published", "loader_blocked",
                                                              "loader_late", "data_wait")},
                          "median_to_published": round(statistics.median(d["pub"]), 3)} for k, d in kinds.items()}}


def stage_of(table, insts) -> list[int]:
    """Each instruction's stage: the counter it signals, or (a merged run's tile before its last,
    signalling nothing itself) the next counter its CTA's list signals; -1 past the last."""
    table = np.asarray(table).reshape(-1, 2)
    out = [-1] * len(insts)
    for first, count in table:
        nxt = -1
        for j in range(first + count - 1, first - 1, -1):
            if insts[j].signal >= 0:
                nxt = insts[j].signal
            out[j] = nxt
    return out


def timeline(stamps, table, insts) -> dict:
    """The traced launch's stages in the order they finished, from the kernel's clock (stamps: ns,
    kinds.TRACE_STAMPS a row): a stage is the instructions closing one counter; its time is from the
    stage before's last publish to its own last, and its met wait how long after that its first
    instruction's wait was met (the hand-off). Per kind of stage (GEMVs by input width and tiles'
    kind), the count and the median µs of both; the launch's µs."""
    stamps = np.asarray(stamps, dtype=np.int64)
    stage = stage_of(table, insts)
    groups = {}
    for j, g in enumerate(stage):
        if stamps[j, 0] > 0 and g >= 0:
            groups.setdefault(g, []).append(j)
    rows = []
    for js in groups.values():
        names = [insts[j].kind.name + (f"/k{insts[j].fields.get('k')}" if insts[j].kind.name == "gemv" else "")
                 for j in js]
        name = max(set(names), key=names.count)
        rows.append((int(stamps[js, 3].max()), int(stamps[js, 1].min()), name, len(js)))
    rows.sort()
    t0 = int(stamps[:, 0][stamps[:, 0] > 0].min())
    per, prev = {}, t0
    for end, met, name, n in rows:
        d = per.setdefault(f"{name} x{n}", {"time": [], "met": []})
        d["time"].append((end - prev) / 1e3)
        d["met"].append((met - prev) / 1e3)
        prev = end
    return {"span_us": round((prev - t0) / 1e3, 1),
            "stages": {k: {"n": len(d["time"]), "median_us": round(statistics.median(d["time"]), 2),
                           "median_met_us": round(statistics.median(d["met"]), 2),
                           "total_us": round(sum(d["time"]), 1)}
                       for k, d in sorted(per.items(), key=lambda kv: -sum(kv[1]["time"]))}}


def save_stamps(ex, path: str) -> None:
    """The last launch's stamps (kinds.TRACE_STAMPS, ns) and, per instruction, its CTA, kind, waits,
    counter and fields, as one .npz (`instructions`: a JSON list)."""
    table = ex.built.table.reshape(-1, 2)
    cta = np.full(len(ex.built.instructions), -1)
    for c, (first, count) in enumerate(table):
        cta[first:first + count] = c
    insts = [{"cta": int(cta[j]), "kind": i.kind.name, "waits": [list(w) for w in i.waits], "signal": i.signal,
              "signals": i.signals, "fields": {k: v for k, v in i.fields.items() if isinstance(v, (int, float))}}
             for j, i in enumerate(ex.built.instructions)]
    np.savez_compressed(path, stamps=ex.trace.cpu().numpy().astype("int64"), table=table,
                        instructions=np.array(json.dumps(insts)))


def _value(like, text: str):
    """`text` as the type of `like` (a bool from 0/1/false/true: bool("0") is True)."""
    if isinstance(like, bool):
        if text.lower() not in ("0", "1", "false", "true"):
            raise SystemExit(f"--ab: {text!r} is not a bool (0, 1, false, true)")
        return text.lower() in ("1", "true")
    return type(like)(text)


def compare(dec, spec: str, runs: int, step) -> dict:
    """Each value of one StreamConfig field (`FIELD=V1,V2`) on dec's programs, the kernel timed in
    interleaved rounds; the step's arena after each value must match the first value's (1e-3
    relative: a value may sum in another order). Returns {value: median ms}."""
    field, values = spec.split("=", 1)
    base = {s: e.program.config for s, e in dec.executors.items()}
    times, ref = {}, None
    for r in range(ROUNDS):
        for v in values.split(","):
            for s, e in dec.executors.items():
                e.program.config = dataclasses.replace(base[s], **{field: _value(getattr(base[s], field), v)})
            if r == 0:
                step()
                dec.executor.wait()
                got = dec.executor.arena.clone()
                if ref is None:
                    ref = got
                err = ((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
                if err > 1e-3:
                    raise SystemExit(f"{field}={v}: the step's arena differs from the first value's by {err:.2e}")
            times.setdefault(v, []).append(time_ms(dec.executor.launch, runs, after=dec.executor.wait))
    for s, e in dec.executors.items():
        e.program.config = base[s]
    return {v: statistics.median(t) for v, t in times.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-3.2-1b", choices=sorted(MODELS))
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--splits", type=int, default=0, help="attention shares per KV head (0: the decoder's choice)")
    ap.add_argument("--max-context", type=int, default=0,
                    help="the decoder's max_context, as an engine sizes it (0: context + loop)")
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--loop", type=int, default=32, help="steps of the timed decode loop")
    ap.add_argument("--trace", action="store_true",
                    help="also compile the kernel with StreamConfig.trace and report where each kind of node's "
                         "time goes (µs from the kernel's clock, per CTA: waiting, met wait to first chunk, "
                         "first chunk to published; and `timeline`: each kind of stage's median µs from the "
                         "stage before's last publish to its own, and its hand-off)")
    ap.add_argument("--stamps", default="",
                    help="with --trace: also write the traced launch's raw stamps and every instruction's kind, "
                         "waits, counter and CTA to this .npz (for a critical-path analysis off the GPU)")
    ap.add_argument("--batch", type=int, default=1,
                    help="rows a step decodes, each over blocks of its own (the GEMVs on tensor cores when > 1)")
    ap.add_argument("--ab", default="",
                    help="FIELD=V1,V2,...: also time the same program with a StreamConfig field that shapes no "
                         "memory (a kernel constexpr) set to each value, rounds interleaved, in this process "
                         "(ab_kernel_ms; each value's outputs are checked against the first's)")
    ap.add_argument("--config", default="{}", type=json.loads,
                    help="StreamConfig fields over the model's own, as JSON, e.g. "
                         "'{\"block_rows\": 64, \"block_k\": 128}' (a tile of more weight rows against one x block)")
    args = ap.parse_args()
    cfg = MODELS[args.model]
    t0 = time.time()
    w = random_weights(cfg, "cuda", torch.bfloat16)
    max_context = args.max_context or args.context + args.loop
    b, bs = args.batch, 16
    per_row = -(-max_context // bs)
    kv = torch.zeros(cfg.num_layers, 2, b * per_row, bs, cfg.num_kv_heads, cfg.head_dim, dtype=torch.bfloat16,
                     device="cuda")
    tables = [list(range(r * per_row, (r + 1) * per_row)) for r in range(b)]
    options = dict(max_context=max_context, splits=args.splits or None, batch=b, block_size=bs, kv=kv)

    config = dataclasses.replace(stream_config(cfg, batch_rows=batch_rows(b)), **args.config)
    dec = StreamDecoder(cfg, w, device="cuda", config=config, **options)
    build_s = time.time() - t0
    if not args.trace:
        del w
    pos = args.context - 1

    def step(d):
        d.step_rows([7] * b, [pos] * b, tables)

    def generate(d, steps):
        d.generate_rows([7] * b, [pos] * b, steps, tables)

    step(dec)                                  # compiles, and warms
    rounds = [time_ms(dec.executor.launch, args.runs, after=dec.executor.wait) for _ in range(ROUNDS)]
    kernel = statistics.median(rounds)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(args.runs):
        step(dec)
    host = (time.perf_counter() - t) / args.runs * 1e3
    generate(dec, args.loop)
    loop = time_ms(lambda: dec.executor.launch(args.loop), max(3, args.runs // 4), after=dec.executor.wait)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(3):
        generate(dec, args.loop)
    loop_host = (time.perf_counter() - t) / 3 / args.loop * 1e3
    ab = compare(dec, args.ab, args.runs, lambda: step(dec)) if args.ab else None
    wbytes = sum(p.numel() * 2 for p in dec.program.pools)
    kv = b * cfg.num_layers * 2 * args.context * cfg.num_kv_heads * cfg.head_dim * 2
    floor = (wbytes + kv) / copy_rate() * 1e3
    out = {"model": args.model, "device": torch.cuda.get_device_name(), "context": args.context, "batch": b,
           "config": dataclasses.asdict(config),
           "max_context": dec.max_context, "tokens_per_s": b * 1e3 / kernel,
           "splits": dec.splits, "level": dec.level(args.context),
           "loop_level": dec.level(args.context + args.loop - 1), "nodes": len(dec.program.nodes),
           "build_s": round(build_s, 1),
           "kernel_ms": kernel, "kernel_ms_rounds": rounds, "step_ms_host_driven": host, "loop_steps": args.loop,
           "loop_ms_per_token": loop / args.loop, "loop_ms_per_token_host_driven": loop_host,
           "floor_ms": floor, "weight_bytes": wbytes, "kv_bytes": kv, "pct_of_floor": 100 * floor / kernel}
    if ab:
        out["ab_kernel_ms"] = ab
    if args.trace:
        traced = StreamDecoder(cfg, w, device="cuda", config=dataclasses.replace(config, trace=True), **options)
        del dec
        for _ in range(3):
            step(traced)
        out["anatomy"] = anatomy(traced.executor)
        ex = traced.executor
        out["timeline"] = timeline(ex.trace.cpu().numpy(), ex.built.table, ex.built.instructions)
        if args.stamps:
            save_stamps(traced.executor, args.stamps)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
