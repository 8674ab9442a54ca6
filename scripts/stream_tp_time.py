"""The streaming decoder under tensor parallelism against one GPU (issue 36, item 2): ms a token of
a 32-step greedy decode loop in the kernel, batch 1, Llama-3.1-8B shapes (random bf16 weights), for
each world size asked, each in fresh processes (one a rank and a GPU, NCCL group for the symmetric
memory set-up); the floor is each rank's streamed bytes (its layer shards and its vocabulary shard of the lm_head)
over the measured copy bandwidth. Prints one JSON object; `speedup` is world 1's ms over each.

    python scripts/stream_tp_time.py --worlds 1,2 [--model llama-3.1-8b|small] [--runs 10]

`--device cpu --model small` runs the same processes on the CPU reference (gloo), a smoke test of
this script before it spends device time (tests/test_stream_tp_time.py).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def rank_main(args) -> None:
    import torch
    import torch.distributed as dist

    from scripts.bench_tp import SHAPES
    from warploop.bench.decode import _copy_gbps
    from warploop.bench.timing import seconds
    from warploop.llm.stream_step import StreamDecoder
    from warploop.llm.stream_tp import GroupRank
    from warploop.llm.tp.shard import shard_weights
    from warploop.llm.weights import random_weights

    cfg, world, rank = SHAPES[args.model], args.world, args.rank
    gpu = args.device == "cuda"
    if gpu:
        torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank) if gpu else torch.device("cpu")
    tp = None
    if world > 1:
        dist.init_process_group("nccl" if gpu else "gloo", init_method="file://" + args.rendezvous, rank=rank,
                                world_size=world)
        tp = GroupRank()
    w = random_weights(cfg, dev, torch.bfloat16, seed=0)
    if world > 1:
        w = shard_weights(w, cfg, world, rank)
    dec = StreamDecoder(cfg, w, device=dev, max_context=1024 if gpu else 64, block_size=16, tp=tp)
    steps = 32 if gpu else 4
    dec.generate(1, 0, steps)                       # compiles, places, warms
    times = []
    for _ in range(args.runs):
        if world > 1:
            dist.barrier()
        times.append(seconds(lambda: dec.generate(1, 0, steps), dev) / steps * 1e3)
    lw = w.layers[0]
    layer_bytes = sum(t.numel() * 2 for t in (lw.qkv, lw.o, lw.gate_up, lw.down)) * cfg.num_layers
    floor_bytes = layer_bytes + w.lm_head.numel() * 2
    if rank == 0:
        print(json.dumps({"world": world, "ms_per_token": round(statistics.median(times), 4),
                          "p10": round(sorted(times)[len(times) // 10], 4), "runs": len(times),
                          "floor_ms": round(floor_bytes / (_copy_gbps(dev) * 1e9) * 1e3, 4),
                          "rank_weight_gb": round(floor_bytes / 1e9, 3)}))
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


def run_world(args, world: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, NCCL_NVLS_ENABLE="0", PYTHONPATH=str(ROOT))
        procs = [subprocess.Popen([sys.executable, __file__, "--model", args.model, "--runs", str(args.runs),
                                   "--device", args.device, "--world", str(world), "--rank", str(r),
                                   "--rendezvous", f"{tmp}/rdv"],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
                 for r in range(world)]
        outs = [p.communicate(timeout=args.timeout) for p in procs]
    if any(p.returncode for p in procs):
        return {"world": world, "error": "; ".join(err[-1500:] for _, err in outs if err)}
    return json.loads(outs[0][0].strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-3.1-8b", choices=["llama-3.1-8b", "small"])
    ap.add_argument("--worlds", default="1,2", help="comma-separated world sizes (each in fresh processes)")
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: the CPU reference (a smoke test)")
    ap.add_argument("--timeout", type=int, default=400, help="seconds for one world size's processes")
    ap.add_argument("--world", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--rendezvous", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank is not None:
        rank_main(args)
        return 0
    results = [run_world(args, int(w)) for w in args.worlds.split(",")]
    one = next((r["ms_per_token"] for r in results if r.get("world") == 1 and "ms_per_token" in r), None)
    for r in results:
        if one and "ms_per_token" in r:
            r["speedup"] = round(one / r["ms_per_token"], 3)
    print(json.dumps({"model": args.model, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
