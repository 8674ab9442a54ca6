"""The streaming decoder under tensor parallelism through the engine, on the CPU: two ranks (this
process and one spawned worker, gloo), each decoding on its own streaming program (the CPU reference,
its all-reduce nodes gathering the peer's partials over torch.distributed) and prefilling per op.

Two ranks' bf16 per-op prefill rounds otherwise than one process's, so the checks are: the logits of
every step within that rounding of one process's streaming backend; and, on two ranks, the decode
loops' greedy tokens equal to single steps' (the same programs: the same bits), through the engine."""
from __future__ import annotations

import pytest
import torch

from warploop.llm.backend import ModelBatch
from warploop.llm.build import build_backend
from warploop.llm.engine import Engine, SamplingParams
from warploop.llm.loader import load_config, load_weights, resolve_model_dir
from warploop.llm.tokenizer import Tokenizer
from warploop.llm.tp.build import RankJob, build_tp_backend

CPU = torch.device("cpu")
BLOCKS = 32


def test_two_ranks_steps_and_loops_against_one_process():
    path = resolve_model_dir("tiny")
    cfg = load_config(path)
    job = RankJob(cfg, str(path), "bfloat16", block_size=16, num_kv_blocks=16, max_num_seqs=4, max_len=256,
                  use_cuda_graphs=False, backend="stream")
    tp, _ = build_tp_backend(cfg, 2, CPU, job)
    try:
        ref, _ = build_backend(cfg, load_weights(path, cfg, CPU, torch.bfloat16, progress=False), CPU,
                               num_kv_blocks=16, use_cuda_graphs=False, backend="stream")
        prompt = Tokenizer(path).encode("class Tree:")
        n, table = len(prompt), [0, 1, 2]
        first = ModelBatch(prompt, list(range(n)), [n], [n], [table])
        tok = int(ref.forward(first)[-1].argmax())
        tp.forward(first)
        start = tok
        # 12 steps from position 5: the last writes block 1's first slot (of 16) and attends across both
        for pos in range(n, n + 12):          # teacher-forced: the same token into both, every step
            got, want = tp.decoder.step(tok, pos, table).float(), ref.decoder.step(tok, pos, table).float()
            assert (got - want).abs().max().item() < 0.1 * max(1.0, want.abs().max().item() / 10), pos
            tok = int(want.argmax())
        # the loop against single steps on the two ranks, from the same state: the same tokens
        looped = tp.decoder.generate(start, n, 12, table)
        stepped, tok = [], start
        for pos in range(n, n + 12):
            tok = int(tp.decoder.step(tok, pos, table).argmax())
            stepped.append(tok)
        assert looped == stepped
    finally:
        tp.close()


def test_the_engine_on_two_ranks_decodes_in_loops_as_in_single_steps(monkeypatch):
    from warploop.llm import stream_backend
    monkeypatch.setattr(stream_backend, "MAX_STEPS", 6)     # 12 tokens: loops of 6 and 5 steps, past a block
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    outs = []
    with Engine.from_model("tiny", device="cpu", dtype="bfloat16", backend="stream", num_kv_blocks=BLOCKS,
                           progress=False, tensor_parallel=2) as engine:
        for loops in (True, False):      # one engine (one worker to start), idle in between
            engine.decode_loop = loops
            before = engine.stats()["decode_loops"]
            outs.append([engine.generate(p, params).token_ids for p in ("def add(a, b):", "class Tree:")])
            assert (engine.stats()["decode_loops"] - before >= 2) == loops and all(len(t) == 12 for t in outs[-1])
    assert outs[0] == outs[1]


def test_a_backend_that_cannot_split_is_refused_before_any_process_starts():
    import multiprocessing
    with pytest.raises(ValueError, match="--backend megakernel does not run under --tensor-parallel"):
        Engine.from_model("tiny", device="cpu", backend="megakernel", tensor_parallel=2)
    with pytest.raises(ValueError, match="streaming backend cannot run this model: it runs bfloat16 models"):
        Engine.from_model("tiny", device="cpu", dtype="float32", backend="stream", tensor_parallel=2)
    assert not multiprocessing.active_children()
