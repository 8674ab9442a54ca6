"""Time MLP stack schedules of the runtime bench in one process, interleaved (GPU only).

    PYTHONPATH=. python scripts/mlp_variants.py OUT.json worker_tile_ahead2,worker_tile_8k_ahead4 ROUNDS

Each named schedule (warploop.bench.runtime_mlp_tasks.MLP_VARIANTS) runs in its own runtime, ROUNDS
times in turn, on the same weights; it prints µs per stack, % of the copy floor and the error against
fp32, and writes {"floor_us": ..., name: [µs per round]} to OUT.json. Interleaving matters: a
schedule's time can drift between device sessions, so compare schedules within one run.
"""
import json
import sys

import torch

from warploop.bench.runtime_gpu import copy_gbs, mlp_weights, reference, rel_err, runtime_mlp


def main() -> None:
    out, names = sys.argv[1], sys.argv[2].split(",")
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    w1, w2, x0 = mlp_weights(torch, 16)
    ref = reference(torch, w1, w2, x0)
    floor = sum(w.numel() * 2 for w in w1 + w2) / (copy_gbs(torch) * 1e9) * 1e6
    res = {"floor_us": floor}
    for _ in range(rounds):
        for n in names:
            try:
                r = runtime_mlp(torch, w1, w2, x0, repeat=20, variant=n)
                e = rel_err(torch, r["warploop_out"], ref)
                line = f"{n:26s} {r['warploop_us']:7.1f} us  {100 * floor / r['warploop_us']:5.1f}% floor  err {e:.3g}"
                res.setdefault(n, []).append(r["warploop_us"])
            except Exception as exc:  # report and go on with the other schedules
                line = f"{n:26s} ERROR {exc!r}"[:600]
            print(line, flush=True)
    print(f"floor {floor:.1f} us")
    with open(out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
