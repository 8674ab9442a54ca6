"""Tensor parallelism on the CPU: two ranks (this process and one spawned worker) over gloo. Their
logits equal the unsharded model's for the tiny model and for a random Qwen3 config whose single KV
head is replicated, with biases and an odd vocabulary; the engine and `warploop generate` produce
the same greedy tokens as one process; a dead rank fails the step with a clear error, not a hang."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.llm_helpers import make_model_dir
from warploop.llm.backend import ModelBatch
from warploop.llm.build import build_backend
from warploop.llm.loader import load_config, load_weights, resolve_model_dir
from warploop.llm.tp.build import RankJob, build_tp_backend

CPU = torch.device("cpu")
BLOCKS = 16


def backends(path):
    """(two-rank backend, unsharded backend) over the same checkpoint, fp32."""
    cfg = load_config(path)
    job = RankJob(cfg, str(path), "float32", block_size=16, num_kv_blocks=BLOCKS, max_num_seqs=4, max_len=256,
                  use_cuda_graphs=False)
    tp, _ = build_tp_backend(cfg, 2, CPU, job)
    ref, _ = build_backend(cfg, load_weights(path, cfg, CPU, torch.float32, progress=False), CPU,
                           num_kv_blocks=BLOCKS, use_cuda_graphs=False)
    return tp, ref


def assert_same_logits(tp, ref, vocab: int) -> None:
    """A two-sequence prefill, then two decode steps, the second with its ids on the device (the path
    where rank 0 broadcasts the sampled ids)."""
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randint(0, vocab, (37,), generator=gen).tolist(), torch.randint(0, vocab, (9,), generator=gen).tolist()
    tables = [[0, 1, 2], [3]]
    steps = [ModelBatch(a + b, list(range(37)) + list(range(9)), [37, 9], [37, 9], tables),
             ModelBatch([5, 6], [37, 9], [1, 1], [38, 10], tables),
             ModelBatch(torch.tensor([7, vocab - 1]), [38, 10], [1, 1], [39, 11], tables)]
    for batch in steps:
        got, want = tp.forward(batch), ref.forward(batch)
        assert got.shape == want.shape == (2, vocab)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))


def test_tiny_two_ranks_match_one():
    tp, ref = backends(resolve_model_dir("tiny"))
    try:
        assert_same_logits(tp, ref, 4096)
    finally:
        tp.close()


def test_random_qwen3_replicated_kv_head_matches_one(tmp_path):
    path, _ = make_model_dir(tmp_path, "qwen3", num_key_value_heads=1, attention_bias=True, vocab_size=259)
    tp, ref = backends(path)
    try:
        assert tp.shard.layout.num_kv_heads == 1 and tp.shard.w.embed.shape[0] == 130
        assert tp.shard.w.layers[0].o_bias is not None   # rank 0 keeps the row-parallel bias
        assert_same_logits(tp, ref, 259)
    finally:
        tp.close()


def test_a_dead_rank_fails_the_step_with_a_clear_error():
    from warploop.llm.tp.group import RankFailed

    tp, _ = backends(resolve_model_dir("tiny"))
    try:
        tp.ranks.procs[0].kill()
        tp.ranks.procs[0].join(10)
        with pytest.raises(RankFailed, match="rank 1 .* exited"):
            tp.forward(ModelBatch([1, 2], [0, 1], [2], [2], [[0]]))
    finally:
        tp.close()


def test_engine_greedy_tokens_match_one_process():
    from warploop.llm.engine import Engine, SamplingParams

    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    outs = []
    for n in (1, 2):
        with Engine.from_model("tiny", device="cpu", dtype="float32", num_kv_blocks=BLOCKS, progress=False,
                               tensor_parallel=n) as engine:
            outs.append(engine.generate("def add(a, b):", params).token_ids)
    assert outs[0] == outs[1] and len(outs[0]) == 12


def test_refused_before_any_process_starts():
    from warploop.llm.engine import Engine
    from warploop.llm.tp.shard import TensorParallelError

    with pytest.raises(TensorParallelError, match="--tensor-parallel 3: the model's 4 attention heads"):
        Engine.from_model("tiny", device="cpu", progress=False, tensor_parallel=3)
    import multiprocessing
    assert not multiprocessing.active_children()


def test_generate_cli_with_two_ranks():
    env = dict(os.environ, WARPLOOP_DEVICE="cpu")
    cmd = [sys.executable, "-m", "warploop.cli", "generate", "--model", "tiny", "--prompt", "import ",
           "--max-tokens", "6", "--json", "--dtype", "float32"]
    one = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    two = subprocess.run([*cmd, "--tensor-parallel", "2"], capture_output=True, text=True, env=env, timeout=300)
    assert one.returncode == 0 and two.returncode == 0, two.stderr
    assert json.loads(one.stdout)["token_ids"] == json.loads(two.stdout)["token_ids"]
    bad = subprocess.run([*cmd, "--tensor-parallel", "3"], capture_output=True, text=True, env=env, timeout=300)
    assert bad.returncode == 2 and "attention heads" in bad.stderr.strip().splitlines()[-1]


def test_bench_tp_script_runs_on_the_cpu(tmp_path):
    """scripts/bench_tp.py (issue 13's figures on two GPUs), smoke-tested on a 2-layer model over gloo:
    it writes its checkpoint, starts two ranks and reports both figures."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    args = ["--part", "tp", "--shapes", "small", "--device", "cpu", "--steps", "2", "--repeats", "1",
            "--dir", str(tmp_path / "ckpt")]
    proc = subprocess.run([sys.executable, os.path.join(root, "scripts", "bench_tp.py"), *args],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout)
    assert result["weight_bytes"] > 0 and result["floor_ms_tp2"] < result["floor_ms_1gpu"]
    assert result["tp"]["ms_per_token_bs1"] > 0 and result["tp"]["tok_s_bs32"] > 0, result["tp"]
