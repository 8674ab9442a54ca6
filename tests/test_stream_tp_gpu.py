"""The streaming kernel under tensor parallelism on two Hopper GPUs (skips without them): each rank a
process and a GPU, its program's all-reduce nodes meeting the peer's kernel through symmetric memory
(allreduce.py). The ranks' logits are the same bits; they equal one GPU's decoder within bf16 KV
rounding, and the decode loop's greedy tokens equal one GPU's for 32 steps. Each check runs in fresh processes
(a symmetric-memory group is set up once a process)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2
                                or torch.cuda.get_device_capability()[0] != 9, reason="needs two Hopper GPUs")

HERE = os.path.dirname(os.path.abspath(__file__))
PROMPT = [3, 17, 5, 60, 2, 41]
RANK = """
import os, sys, torch, torch.distributed as dist
sys.path[:0] = [{root!r}, {tests!r}]
from test_stream_step import CONFIGS, bf16_exact_weights
from warploop.llm.stream_step import StreamDecoder
from warploop.llm.stream_tp import GroupRank
from warploop.llm.tp.shard import shard_weights
rank, world, name = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
torch.cuda.set_device(rank)
dist.init_process_group("nccl", init_method="file://" + sys.argv[4], rank=rank, world_size=world)
cfg = CONFIGS[name]
w = shard_weights(bf16_exact_weights(cfg, "cuda"), cfg, world, rank)   # one_gpu's weights, sharded
dec = StreamDecoder(cfg, w, device="cuda", max_context=64, block_size=16, tp=GroupRank())
logits = [dec.step(t, p).float().cpu().clone() for p, t in enumerate({prompt})]
tokens = dec.generate(int(logits[-1].argmax()), len({prompt}), 32)
torch.save((logits, tokens), sys.argv[5])
dist.barrier()
dist.destroy_process_group()
"""


def one_gpu(name):
    from test_stream_step import CONFIGS, bf16_exact_weights

    from warploop.llm.stream_step import StreamDecoder
    cfg = CONFIGS[name]
    dec = StreamDecoder(cfg, bf16_exact_weights(cfg, "cuda"), device="cuda", max_context=64, block_size=16)
    logits = [dec.step(t, p).float().cpu().clone() for p, t in enumerate(PROMPT)]
    return logits, dec.generate(int(logits[-1].argmax()), len(PROMPT), 32)


@pytest.mark.parametrize("name", ["llama3", "qwen3_qk_norm", "qwen2_bias"])
def test_two_ranks_give_one_gpus_logits_and_tokens(name, tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(RANK.format(root=os.path.dirname(HERE), tests=HERE, prompt=PROMPT))
    outs = [tmp_path / f"rank{r}.pt" for r in range(2)]
    procs = [subprocess.Popen([sys.executable, str(script), str(r), "2", name, str(tmp_path / "rendezvous"),
                               str(outs[r])], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(2)]
    try:
        logs = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(log[-3000:] for log in logs)
    (l0, t0), (l1, t1) = (torch.load(o) for o in outs)
    assert all(torch.equal(a, b) for a, b in zip(l0, l1, strict=True)) and t0 == t1
    want_logits, want_tokens = one_gpu(name)
    for a, b in zip(l0, want_logits, strict=True):
        assert ((a - b).norm() / b.norm()).item() < 2e-2
    assert t0 == want_tokens
