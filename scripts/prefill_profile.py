"""Where a prefill's time goes: the CUDA kernels of one N-token prompt's prefill on the per-op backend
(the engine's) and on the torch.compile peer (gpt-fast style, SDPA), each profiled by torch.profiler
over a few runs after warm-up. Prints one JSON object: per system, the device total a run and the
top kernels (name, calls a run, µs a run), so `bench prefill`'s gap (issue 34) has a cause.

    python scripts/prefill_profile.py [--model llama-3.2-1b] [--tokens 1024] [--runs 5] [--top 15]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def profile(fn, runs: int, top: int) -> dict:
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    fn()
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(runs):
            fn()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if us > 0:
            rows.append({"kernel": e.key[:120], "calls": round(e.count / runs, 2), "us": round(us / runs, 1)})
    rows.sort(key=lambda r: -r["us"])
    return {"device_us": round(sum(r["us"] for r in rows), 1), "kernels": len(rows), "top": rows[:top]}


def ours(cfg, device, dtype, n: int, args) -> dict:
    import torch

    from warploop.bench.prefill import _backend
    from warploop.llm.backend import ModelBatch
    backend, _ = _backend(cfg, device, dtype, n)
    ids = torch.randint(0, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(0)).tolist()
    batch = ModelBatch(ids, list(range(n)), [n], [n], [list(range(-(-n // 16)))])
    with torch.no_grad():
        return profile(lambda: backend.forward(batch), args.runs, args.top)


def main() -> int:
    import torch

    from warploop.bench.decode_peers import CompiledDecoder, gptfast_model
    from warploop.llm.shapes import GPU_MODELS

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-3.2-1b", choices=sorted(GPU_MODELS))
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--top", type=int, default=15)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        ap.error("needs a GPU (the profile is of CUDA kernels)")
    device, dtype = torch.device("cuda"), torch.bfloat16
    cfg, n = GPU_MODELS[args.model][1], args.tokens
    out = {"model": args.model, "tokens": n, "runs": args.runs}
    out["warploop"] = ours(cfg, device, dtype, n, args)
    torch.cuda.empty_cache()
    model = gptfast_model(cfg, device, dtype)
    dec = CompiledDecoder(model, use_cuda_graphs=False)
    prompt = torch.randint(0, cfg.vocab_size, (1, n), device=device)
    with torch.no_grad():
        model.setup_caches(1, n)
        at = torch.arange(n, device=device)
        dec.prefill(prompt, at)                     # compiles
        out["torch_compile"] = profile(lambda: dec.prefill(prompt, at), args.runs, args.top)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
