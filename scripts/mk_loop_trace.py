"""The decode loop on a GPU: one loop request of N batch-1 steps, with no host message between them.

    PYTHONPATH=$PWD python scripts/mk_loop_trace.py --model llama-3.2-1b --steps 32 [--trace OUT.json]

Runs the model's batch-1 graph (random bf16 weights) as N single steps, then as one loop request
of N steps from the same state, and reports: the tokens of both (equal), the host messages each
sent to the resident kernel (graph requests and task submissions, read from the runtime's own
counters), device time per step, and when each step's token reached the host. With --trace,
the runtime records the loop request's nodes (a Perfetto trace: N runs of the graph, one request).
One JSON object is printed. The plan comes from WARPLOOP_MK_PLAN, as for the engine.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")

from mk_probe import BLOCK, PROMPT, make, prefill  # noqa: E402

from warploop.llm.mk.loop import LOOP_STEPS, MAX_STEPS  # noqa: E402
from warploop.llm.mk.plans import env_options  # noqa: E402
from warploop.llm.shapes import GPU_MODELS  # noqa: E402


class Greedy:
    class params:
        temperature, top_k, top_p, min_p, repetition_penalty, seed = 0.0, 0, 1.0, 0.0, 1.0, 1


def host_messages(rt) -> dict:
    return {"graph_requests": rt._greq, "task_submissions": rt._ticket}  # noqa: SLF001


def single_steps(mk, batch, steps: int, out: dict, tokens: list) -> None:
    t0 = time.perf_counter()
    before = host_messages(mk.rt)
    for i in range(steps):
        mk.forward_sample(batch, [Greedy()])
        token = int(mk.last.buffers.tokens[0])
        tokens.append(token)
        n = PROMPT + 1 + i
        batch = type(batch)([token], [n], [1], [n + 1], batch.block_tables)
    after = host_messages(mk.rt)
    out["single_steps"] = {"ms_per_token": round((time.perf_counter() - t0) * 1e3 / steps, 3),
                           **{k: after[k] - before[k] for k in after}}


def write_trace(mk, path: str, arrivals: list[float], tokens: list[int], summary: dict) -> dict:
    """A Perfetto (Chrome JSON, gzipped) trace of the loop request: one slice per device step (from
    one advance node's end to the next), every node of the middle step on its worker's track, and
    each token's arrival on the host (host clock, from the launch)."""
    events = mk.rt._backend.trace_events()  # noqa: SLF001
    dg = mk.last
    sink = dg.labels.index("advance")
    ends = sorted(e[1] for e in events if e[4] == sink and e[2] != 0)[-len(tokens):]
    origin = min(e[0] for e in events if e[0] >= ends[0] - 10 ** 8) if ends else 0
    starts = [origin] + ends[:-1]
    mid = len(ends) // 2
    doc = [{"ph": "M", "name": "process_name", "pid": 0, "args": {"name": "device: one loop request"}},
           {"ph": "M", "name": "thread_name", "pid": 0, "tid": 0, "args": {"name": "decode steps"}},
           {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "host (its own clock, from the launch)"}}]
    for k, (a, b) in enumerate(zip(starts, ends, strict=True)):
        doc.append({"ph": "X", "name": f"step {k}", "pid": 0, "tid": 0, "ts": (a - origin) / 1e3,
                    "dur": (b - a) / 1e3, "args": {"token": tokens[k]}})
    names = mk.rt.names
    for start, end, opcode, worker, ident in events:
        if ends and starts[mid] <= start and end <= ends[mid]:
            doc.append({"ph": "X", "name": dg.labels[ident] if opcode else "nop", "pid": 0, "tid": 1 + worker,
                        "ts": (start - origin) / 1e3, "dur": max(end - start, 0) / 1e3,
                        "args": {"node": ident, "task": names.get(opcode, "nop")}})
    for k, t in enumerate(arrivals):
        doc.append({"ph": "i", "s": "t", "name": f"token {k} on the host", "pid": 1, "tid": 0, "ts": t * 1e6})
    doc.append({"ph": "M", "name": "process_labels", "pid": 0, "args": {"labels": json.dumps(summary)}})
    import gzip
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": doc, "displayTimeUnit": "ns"}, f)
    return {"path": path, "device_steps": len(ends), "detail_step": mid,
            "step_us_median": round(statistics.median([(b - a) / 1e3 for a, b in zip(starts, ends, strict=True)]), 1)
            if ends else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="llama-3.2-1b", choices=sorted(GPU_MODELS))
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--trace", help="write the loop request's Perfetto trace here (.json.gz); skips the single steps")
    args = ap.parse_args()
    cfg = GPU_MODELS[args.model][1]
    mk, start_s = make(cfg, env_options(), [1], trace=bool(args.trace))
    out = {"model": args.model, "steps": args.steps, "start_s": round(start_s, 1), "plan": mk.plan.key}
    # single steps: the host writes each step's inputs and waits for its token (not with --trace:
    # the trace rings then hold the loop request alone)
    batch = prefill(mk, 1)
    single = []
    if not args.trace:
        single_steps(mk, batch, args.steps, out, single)
    # one loop request from the same state; its free list is the table's own next blocks (the
    # prefill gave the row a table for its whole context), taken in order as the row reaches them
    batch = prefill(mk, 1)
    free = batch.block_tables[0][-(-(PROMPT + 1) // BLOCK):][:MAX_STEPS // BLOCK + 1]
    before = host_messages(mk.rt)
    t0 = time.perf_counter()
    run = mk.start_loop(batch, [Greedy()], args.steps, [args.steps + 1], [[]], free)
    arrivals, tokens = [], []
    while not run.finished():
        got, _ = run.take(wait_s=1.0)
        now = time.perf_counter()
        for row in got:
            arrivals.append(now - t0)
            tokens.append(int(row[0]))
    after = host_messages(mk.rt)
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
    out["loop"] = {"status_steps": run.status == LOOP_STEPS,
                   "ms_per_token": round(arrivals[-1] * 1e3 / args.steps, 3),
                   "device_us_per_step": round(run.future.device_ns / 1e3 / args.steps, 1),
                   "arrival_gap_us_median": round(statistics.median(gaps) * 1e6, 1) if gaps else None,
                   "first_token_ms": round(arrivals[0] * 1e3, 3),
                   **{k: after[k] - before[k] for k in after}}
    out["tokens"] = tokens[:8]
    if not args.trace:
        out["loop"]["tokens_equal_single_steps"] = tokens == single
    if args.trace:
        out["trace"] = write_trace(mk, args.trace, arrivals, tokens, out["loop"])
    mk.close()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
