"""Print the decode megakernel's graph for a model's shapes (no weights, no GPU): nodes per kind,
counters, instructions per worker, for a worker count and batch sizes.

    PYTHONPATH=$PWD python scripts/mk_graph_shape.py --workers 131 --batch 1 32

Addresses are all zero: only placement and counters are computed (nothing runs or is uploaded).
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import json

from warploop.llm.mk.graph import StepBuffers, build_decode_graph, describe
from warploop.llm.mk.plans import plan_for
from warploop.llm.mk.tasks import tasks_for
from warploop.llm.shapes import LLAMA_3_2_1B
from warploop.llm.weights import LayerWeights, ModelWeights
from warploop.runtime import Runtime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=131, help="worker programs (H200 at 2 per SM: 263)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-context", type=int, default=4096)
    args = parser.parse_args()
    cfg = LLAMA_3_2_1B
    plan = plan_for(cfg, "bfloat16", args.block_size, "cuda")
    tasks = tasks_for(plan)
    weights = ModelWeights(embed=0, layers=[], norm=0, lm_head=0)
    weights.layers = [LayerWeights(0, 0, None, 0, None, 0, 0, None, 0, None, None, None)] * cfg.num_layers
    kv = collections.defaultdict(int)
    width = -(args.max_context // -args.block_size)
    out = {"model": "Llama-3.2-1B shapes", "plan": plan.key, "workers": args.workers, "graphs": []}
    with Runtime(device="cpu", workers=args.workers, tasks=tasks.all) as rt:
        for batch in args.batch:
            buffers = StepBuffers(*([0] * len(dataclasses.fields(StepBuffers))))
            dg = build_decode_graph(rt, tasks, plan, cfg, weights, kv, 0, 0, buffers, batch, width, args.workers)
            out["graphs"].append(describe(dg))
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
