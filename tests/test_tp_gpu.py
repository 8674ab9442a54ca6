"""Tensor parallelism over NCCL (skipped without two GPUs): two ranks' logits equal one GPU's for the
tiny model and a random Qwen3 with a replicated KV head (fp32, as on the CPU), with either all-reduce
(NCCL, the default, or the symmetric-memory one-shot kernel: one engine per process, so each of those
runs in a fresh interpreter); the engine's greedy tokens equal one GPU's for 32 steps, with CUDA
graphs captured around the all-reduces and without; a closed engine leaves its group promptly (NCCL's
teardown once hung on captured graphs)."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                reason="needs two GPUs")


def backends(path):
    from warploop.llm.build import build_backend
    from warploop.llm.loader import load_config, load_weights
    from warploop.llm.tp.build import RankJob, build_tp_backend

    cfg = load_config(path)
    cuda = torch.device("cuda", 0)
    job = RankJob(cfg, str(path), "float32", block_size=16, num_kv_blocks=16, max_num_seqs=4, max_len=256,
                  use_cuda_graphs=False)
    tp, _ = build_tp_backend(cfg, 2, cuda, job)
    ref, _ = build_backend(cfg, load_weights(path, cfg, cuda, torch.float32, progress=False), cuda,
                           num_kv_blocks=16, use_cuda_graphs=False)
    return tp, ref


def check_logits(model: str, tmp: str) -> str:
    """Two ranks' logits against one GPU's for `model`, with the all-reduce the environment names;
    returns the mode the backend used."""
    from pathlib import Path

    from tests.llm_helpers import make_model_dir
    from tests.test_tp_gloo import assert_same_logits
    from warploop.llm.loader import resolve_model_dir

    if model == "tiny":
        path, vocab = resolve_model_dir("tiny"), 4096
    else:
        path, vocab = make_model_dir(Path(tmp), "qwen3", num_key_value_heads=1, attention_bias=True,
                                     vocab_size=259)[0], 259
    tp, ref = backends(path)
    try:
        assert_same_logits(tp, ref, vocab)
        return tp.shard.reduce.mode
    finally:
        tp.close()


@pytest.mark.parametrize("model", ["tiny", "qwen3"])
def test_nccl_two_ranks_match_one_gpu(model, tmp_path, monkeypatch):
    monkeypatch.delenv("WARPLOOP_TP_ALLREDUCE", raising=False)
    assert check_logits(model, str(tmp_path)) == "nccl"


@pytest.mark.parametrize("model", ["tiny", "qwen3"])
def test_symmetric_memory_two_ranks_match_one_gpu(model, tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = (f"from tests.test_tp_gpu import check_logits; import sys; "
            f"sys.exit(check_logits({model!r}, {str(tmp_path)!r}) != 'symm')")
    env = {**os.environ, "WARPLOOP_TP_ALLREDUCE": "symm", "PYTHONPATH": root}
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.parametrize("graphs", [True, False], ids=["cuda-graphs", "eager"])
def test_greedy_tokens_equal_one_gpu_for_32_steps(graphs):
    from warploop.llm.engine import Engine, SamplingParams

    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    outs = []
    for n in (1, 2):
        with Engine.from_model("tiny", device="cuda", dtype="float32", num_kv_blocks=64, max_num_seqs=4,
                               progress=False, tensor_parallel=n, use_cuda_graphs=graphs) as engine:
            outs.append([engine.generate(p, params).token_ids for p in ("def add(a, b):", "import os\n")])
    assert outs[0] == outs[1] and all(len(t) == 32 for t in outs[0])


def test_close_leaves_the_group_promptly():
    """Closing a TP=2 engine with captured graphs: the worker exits and rank 0 leaves the group well
    within the 30 s bound either waits (release the graphs first, leave together)."""
    import torch.distributed as dist

    from warploop.llm.engine import Engine, SamplingParams

    engine = Engine.from_model("tiny", device="cuda", dtype="float32", num_kv_blocks=64, max_num_seqs=4,
                               progress=False, tensor_parallel=2, use_cuda_graphs=True)
    engine.generate("def add(a, b):", SamplingParams(max_tokens=4, temperature=0))
    procs = list(engine.backend.ranks.procs)
    t0 = time.monotonic()
    engine.close()
    took = time.monotonic() - t0
    assert not dist.is_initialized() and not any(p.is_alive() for p in procs)
    assert took < 15, f"closing took {took:.1f} s"
