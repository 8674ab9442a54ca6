"""The anatomy of a streamed decode step's weight stream, from the kernel's own clock.

Runs `warploop bench stream`'s chain for one model with StreamConfig(trace=True): every instruction
stamps %globaltimer when it starts, when its waits are met, when its first chunk is in the ring and
when it has published, and the loader when its first chunk's slot is free and how long it waited for
free slots (its SM's copies idle, the ring full: loader_blocked). Prints one JSON object: where each
CTA's time goes (µs, averaged over CTAs), and per kind of stage how long a published counter takes
to reach its consumers and how long they then take to their first chunk.

    PYTHONPATH=. python scripts/stream_trace.py --model llama-3.2-1b
"""
import argparse
import json
import statistics
import sys

import torch

from warploop.bench.stream_chain import layer_chain
from warploop.llm.shapes import GPU_MODELS
from warploop.llm.stream_step import attention_splits, stream_config
from warploop.runtime.stream.executor import StreamExecutor


def anatomy(ex, chain) -> dict:
    built = ex.built
    stamps = ex.trace.cpu().numpy().astype("int64")
    nodes = [i.node for lst in built.schedule.lists for i in lst]
    cta_of = [c for c, lst in enumerate(built.schedule.lists) for _ in lst]
    kind = {}
    for name, tiles in chain.stages:
        for t in tiles:
            kind[t] = name.rstrip("0123456789")
    t0 = stamps[:, 0][stamps[:, 0] > 0].min()
    s = (stamps - t0) / 1e3                       # µs from the step's first instruction
    span = s[:, 3].max()
    per_cta = {"wait": 0.0, "seen_to_first_chunk": 0.0, "first_chunk_to_published": 0.0, "between": 0.0,
               "loader_blocked": 0.0}
    last_pub = {}
    for c in range(ex.ctas):
        first, count = built.table[2 * c], built.table[2 * c + 1]
        for j in range(first, first + count):
            per_cta["wait"] += s[j, 1] - s[j, 0]
            per_cta["seen_to_first_chunk"] += s[j, 2] - s[j, 1]
            per_cta["first_chunk_to_published"] += s[j, 3] - s[j, 2]
            per_cta["loader_blocked"] += stamps[j, 5] / 1e3
            if j > first:
                per_cta["between"] += s[j, 0] - s[j - 1, 3]
    per_cta = {k: v / ex.ctas for k, v in per_cta.items()}
    per_cta["idle_after_last"] = statistics.mean(
        span - s[built.table[2 * c] + built.table[2 * c + 1] - 1, 3] for c in range(ex.ctas) if built.table[2 * c + 1])
    # publish -> seen: a waiting instruction against the latest publish of the counter it waited on
    for j, inst in enumerate(built.instructions):
        if inst.signal >= 0:
            last_pub[inst.signal] = max(last_pub.get(inst.signal, -1e9), s[j, 3])
    seen, first_chunk = {}, {}
    for j, inst in enumerate(built.instructions):
        if inst.waits and nodes[j] >= 0:
            k = kind.get(nodes[j], "?")
            pub = max(last_pub[c] for c, _ in inst.waits)
            seen.setdefault(k, []).append(s[j, 1] - pub)
            first_chunk.setdefault(k, []).append(s[j, 2] - s[j, 1])
    # each stage instance's span (its first start to its last publish) and the bytes it streamed
    where = {node: j for j, node in enumerate(nodes) if node >= 0}
    spans = {}
    for name, tiles in chain.stages:
        js = [where[t] for t in tiles]
        k = name.rstrip("0123456789")
        nbytes = sum(chain.program.nodes[t].kind.cost(chain.program.nodes[t].fields, chain.program.config.block_rows)
                     for t in tiles)
        acc = spans.setdefault(k, [0.0, 0])
        acc[0] += max(s[j, 3] for j in js) - min(s[j, 1] for j in js)   # from the first met wait
        acc[1] += nbytes
    med = lambda v: round(statistics.median(v), 3)
    # per stage kind, each instruction's phases (µs): waiting, met wait to first chunk, first chunk
    # to published; the median and the slowest
    phases = {}
    for j, node in enumerate(nodes):
        if node >= 0:
            ph = phases.setdefault(kind.get(node, "?"), {"wait": [], "to_first": [], "to_published": [],
                                                          "loader_lead": [], "loader_blocked": []})
            ph["wait"].append(s[j, 1] - s[j, 0])
            ph["to_first"].append(s[j, 2] - s[j, 1])
            ph["to_published"].append(s[j, 3] - s[j, 2])
            ph["loader_lead"].append(s[j, 2] - s[j, 4])         # its first slot free to the consumer's first chunk
            ph["loader_blocked"].append(stamps[j, 5] / 1e3)
    return {"span_us": round(span, 1), "per_cta_us": {k: round(v, 1) for k, v in per_cta.items()},
            "stages": {k: {"waits": len(seen[k]), "publish_to_seen_us": med(seen[k]),
                           "seen_to_first_chunk_us": med(first_chunk[k])} for k in seen},
            "stage_spans": {k: {"us": round(v[0], 1), "GBps": round(v[1] / v[0] / 1e3, 1)} for k, v in spans.items()},
            "phases": {k: {p: {"median": med(v), "max": round(max(v), 3)} for p, v in ph.items()}
                       for k, ph in phases.items()},
            "instructions": len(built.instructions), "ctas": ex.ctas, "cta_of_first": cta_of[0]}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-3.2-1b", choices=sorted(GPU_MODELS))
    ap.add_argument("--config", default="8x32x256", help="RINGxROWSxBK")
    ap.add_argument("--context", type=int, default=0, help="tokens of context (0: the weight stream alone)")
    ap.add_argument("--splits", type=int, default=0, help="attention shares per KV head (0: as the bench picks)")
    args = ap.parse_args()
    from warploop.bench.stream import parse_configs
    ring, br, bk = parse_configs(args.config)[0]
    m = GPU_MODELS[args.model][1]
    cfg = stream_config(m, block_rows=br, block_k=bk, ring=ring, trace=True,
                        head_dim=m.head_dim if args.context else 0)
    splits = args.splits or attention_splits(m, cfg, args.context)
    chain = layer_chain(m, cfg, device="cuda", context=args.context, splits=splits)
    ex = StreamExecutor(chain.program)
    for _ in range(5):
        ex.run()
    out = {"model": args.model, "config": args.config, "device": torch.cuda.get_device_name(),
           "context": args.context, "splits": splits}
    out.update(anatomy(ex, chain))
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
