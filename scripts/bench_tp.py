"""Tensor parallelism and replicas on Llama-3.1-8B shapes (bf16, random weights), issue 13's figures:
ms/token at batch 1 and tokens/s at batch 32 on one GPU, with --tensor-parallel 2, and for the
gpt-fast-style torch.compile model on one GPU; tokens/s of two replicas at batch 32 each; the
bandwidth floor of each (weight bytes, divided by the number of GPUs sharing them, over the measured
copy bandwidth). Needs two GPUs; `scripts/device.sh tp` runs it one part a process.

    python scripts/bench_tp.py --part one|tp|tp_eager|compile|replicas [--dir DIR] > part.json

(tp_eager: TP=2 without CUDA graphs, the fallback if capturing NCCL all-reduces fails on a machine;
tp_symm: TP=2 with WARPLOOP_TP_ALLREDUCE=symm, the symmetric-memory all-reduce beside NCCL's.)
`--shapes small --device cpu` runs the same code on a 2-layer model on the CPU (gloo), as a smoke
test of this script before it spends device time (tests/test_tp_gloo.py runs it).

The weights are written once as a checkpoint (`--dir`), so one GPU, TP=2 (each rank reads only its
slices) and the replicas all run the same values.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))     # tests.llm_helpers: the tokenizer
sys.path.insert(0, str(Path(__file__).resolve().parent))         # checkpoint.py

from checkpoint import write_checkpoint  # noqa: E402

from warploop.llm.config import ModelConfig
from warploop.llm.rope import RopeConfig

LLAMA_3_1_8B = ModelConfig(
    family="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
    num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, max_position_embeddings=131072, tie_word_embeddings=False,
    rope=RopeConfig(rope_type="llama3", theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=8192),
    dtype="bfloat16", eos_token_ids=(128001,), bos_token_id=128000)
SMALL = ModelConfig(
    family="llama", vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4,
    num_kv_heads=2, head_dim=32, rms_norm_eps=1e-5, max_position_embeddings=131072, tie_word_embeddings=False,
    rope=LLAMA_3_1_8B.rope, dtype="bfloat16", eos_token_ids=(257,), bos_token_id=256)
SHAPES = {"llama-3.1-8b": LLAMA_3_1_8B, "small": SMALL}
MAX_LEN, BATCH = 1024, 32


def measure(engine, cfg: ModelConfig, steps: int, repeats: int, batch: int = BATCH) -> dict:
    import torch

    from warploop.bench.decode import _engine_tok_s, _median
    from warploop.llm.params import SamplingParams

    gen = torch.Generator().manual_seed(0)

    def prompts(b: int):
        return torch.randint(0, cfg.vocab_size, (b, 32), generator=gen)

    params = SamplingParams(max_tokens=steps + 1, temperature=0, ignore_eos=True)
    out = {}
    if hasattr(engine, "generate"):   # one engine (a replica pool is measured at batch only)
        engine.generate(prompts(1)[0].tolist(), params)
        out["ms_per_token_bs1"] = _median(repeats, lambda: engine.generate(prompts(1)[0].tolist(),
                                                                            params).ms_per_token)
    _engine_tok_s(engine, prompts(batch), params, 8)
    out[f"tok_s_bs{batch}"] = _median(repeats, lambda: _engine_tok_s(engine, prompts(batch), params, steps))
    return out


def main() -> int:
    import torch

    from warploop.bench.common import header
    from warploop.bench.decode import _copy_gbps, _guard, _measure_compiled

    parser = argparse.ArgumentParser()
    parser.add_argument("--part", choices=("one", "tp", "tp_symm", "tp_eager", "compile", "replicas"), required=True)
    parser.add_argument("--backend", choices=("torch", "stream"), default=None,
                        help="the engine's backend for one/tp/replicas (default: the device's); with stream, batch "
                             "1 decodes in the streaming kernel (each rank's under tensor parallelism), batches per op")
    parser.add_argument("--shapes", choices=tuple(SHAPES), default="llama-3.1-8b")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--dir", default=None, help="the checkpoint (default /tmp/<shapes>-random; written if absent)")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    cfg = SHAPES[args.shapes]
    path = Path(args.dir or f"/tmp/{args.shapes}-random")
    if not (path / "config.json").is_file():
        write_checkpoint(path, cfg, args.device)
    result = header("tp")
    result.update(part=args.part, model=f"{args.shapes} shapes, bf16, random weights", steps=args.steps,
                  repeats=args.repeats, gpus=torch.cuda.device_count(),
                  nccl_nvls_enable=os.environ.get("NCCL_NVLS_ENABLE"))
    copy = _copy_gbps(torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu"))
    nbytes = cfg.num_parameters() * 2
    result.update(copy_gbps=round(copy, 1), weight_bytes=nbytes, floor_ms_1gpu=round(nbytes / copy / 1e6, 4),
                  floor_ms_tp2=round(nbytes / 2 / copy / 1e6, 4))
    options = dict(device=args.device, dtype="bfloat16", max_num_seqs=BATCH, max_model_len=MAX_LEN,
                   enable_prefix_caching=False, progress=False, backend=args.backend)
    result["backend"] = args.backend
    # each part prints its figures as soon as they exist: closing an engine (leaving an NCCL group,
    # stopping processes) must not be able to lose them
    if args.part in ("one", "tp", "tp_symm", "tp_eager"):
        from warploop.llm.engine import Engine

        if args.part == "tp_symm":
            os.environ["WARPLOOP_TP_ALLREDUCE"] = "symm"    # the workers inherit it
        with Engine.from_model(str(path), tensor_parallel=1 if args.part == "one" else 2,
                               use_cuda_graphs=args.part != "tp_eager", **options) as engine:
            result[args.part] = _guard(measure, engine, cfg, args.steps, args.repeats)
            shard = getattr(engine.backend, "shard", None)
            if shard is not None:
                result[args.part]["allreduce"] = shard.reduce.mode
            print(json.dumps(result), flush=True)
    elif args.part == "compile":
        def prompts(b: int, length: int = 32):
            return torch.randint(0, cfg.vocab_size, (b, length), device=args.device)

        result["torch_compile"] = _guard(_measure_compiled, cfg, torch.device(args.device), torch.bfloat16,
                                         prompts, args.repeats, args.steps, (BATCH,), False)
        print(json.dumps(result), flush=True)
    else:
        from warploop.llm.replicas import ReplicaPool

        with ReplicaPool(str(path), 2, **options) as pool:
            result["replicas2"] = _guard(measure, pool, cfg, args.steps, args.repeats, 2 * BATCH)
            print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
