"""One layer of a traced decode step (scripts/mk_probe.py --trace), stage by stage, and when its
GEMV tiles finish: the weight bytes completed per time bin, which shows whether workers stream
in step (bursts with idle memory between them) or spread out.

    python scripts/mk_trace_stages.py bench/results/mk-step-trace-....json.gz --layer 8 --tile-kb 64

Per stage: nodes, workers, tiles per worker, the stage's first start and last end relative to the
end of the stage before, the median node time by position in a worker's run, the median gap
between a worker's consecutive nodes, and the spread of the workers' last ends. Node times are
from the traced kernel, whose per-node trace write adds to the gaps.
"""
from __future__ import annotations

import argparse
import collections
import gzip
import json
import statistics

STAGES = ("qkv", "rope_attn", "o_proj", "gate_up", "down")


def load_step(path: str, step: int) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    for e in events:
        e["kind"] = e["name"].split("[")[0].removeprefix("mk_")
    starts = sorted(e["ts"] for e in events if e["kind"] == "embed") + [float("inf")]
    lo, hi = starts[step], starts[step + 1]
    return sorted((e for e in events if lo <= e["ts"] < hi), key=lambda e: e["args"]["id"])


def stage_runs(step: list[dict]) -> list[tuple[str, list[dict]]]:
    """The step's nodes in id (recording) order, grouped into runs of one kind: one run per stage."""
    runs: list[tuple[str, list[dict]]] = []
    for e in step:
        if runs and runs[-1][0] == e["kind"]:
            runs[-1][1].append(e)
        else:
            runs.append((e["kind"], [e]))
    return runs


def end(e: dict) -> float:
    return e["ts"] + e["dur"]


def describe_stage(kind: str, nodes: list[dict], before: float) -> dict:
    per_worker = collections.defaultdict(list)
    for e in nodes:
        per_worker[e["tid"]].append(e)
    by_position, gaps = collections.defaultdict(list), []
    for run in per_worker.values():
        run.sort(key=lambda e: e["ts"])
        for i, e in enumerate(run):
            by_position[i].append(e["dur"])
            if i:
                gaps.append(e["ts"] - end(run[i - 1]))
    ends = sorted(max(end(e) for e in run) - before for run in per_worker.values())
    return {"stage": kind, "nodes": len(nodes), "workers": len(per_worker),
            "nodes_per_worker": dict(collections.Counter(len(r) for r in per_worker.values())),
            "first_start_us": round(min(e["ts"] for e in nodes) - before, 1), "last_end_us": round(ends[-1], 1),
            "median_us_by_position": {i: round(statistics.median(d), 2) for i, d in sorted(by_position.items())},
            "median_gap_us": round(statistics.median(gaps), 2) if gaps else None,
            "worker_end_pctiles_us": [round(ends[int(q * (len(ends) - 1))], 1) for q in (0, 0.1, 0.5, 0.9, 1)]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace")
    parser.add_argument("--step", type=int, default=1, help="which recorded step (0: the first, often cold)")
    parser.add_argument("--layer", type=int, default=8)
    parser.add_argument("--tile-kb", type=int, default=64, help="weight KB per GEMV node (for the byte timeline)")
    parser.add_argument("--bin-us", type=float, default=2.0)
    args = parser.parse_args()
    runs = stage_runs(load_step(args.trace, args.step))
    first = 1 + len(STAGES) * args.layer
    before = max(end(e) for e in runs[first - 1][1])
    for kind, nodes in runs[first:first + len(STAGES)]:
        print(json.dumps(describe_stage(kind, nodes, before)))
        before = max(end(e) for e in nodes)
    # weight bytes completed per bin over the layer (GEMV nodes only), as TB/s
    t_lo = min(e["ts"] for e in runs[first][1])
    t_hi = max(end(e) for e in runs[first + len(STAGES) - 1][1])
    bins = collections.Counter()
    for kind, nodes in runs[first:first + len(STAGES)]:
        if kind != "rope_attn":
            for e in nodes:
                bins[int((end(e) - t_lo) // args.bin_us)] += args.tile_kb << 10
    for b in range(int((t_hi - t_lo) // args.bin_us) + 1):
        rate = bins[b] / (args.bin_us * 1e-6) / 1e12
        print(f"{b * args.bin_us:7.1f} us {rate:5.2f} TB/s " + "#" * round(rate * 10))


if __name__ == "__main__":
    main()
