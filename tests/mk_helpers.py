"""Shared by tests/test_mk_*.py: small random models and a driver that runs the same decode steps
through the megakernel backend and the per-op backend, each over its own paged cache."""
from __future__ import annotations

import torch

from warploop.llm.backend import ModelBatch
from warploop.llm.backend_torch import TorchBackend
from warploop.llm.config import ModelConfig
from warploop.llm.kv_cache import KVCacheLayout
from warploop.llm.mk.backend import MegakernelBackend
from warploop.llm.rope import RopeConfig
from warploop.llm.weights import random_weights

LLAMA_GQA = ModelConfig(family="llama", vocab_size=258, hidden_size=64, intermediate_size=96, num_layers=2,
                        num_heads=4, num_kv_heads=2, head_dim=16, tie_word_embeddings=False,
                        rope=RopeConfig("llama3", 500000.0, 8.0, original_max_position_embeddings=64))
QWEN3_LIKE = ModelConfig(family="qwen3", vocab_size=200, hidden_size=64, intermediate_size=128, num_layers=2,
                         num_heads=4, num_kv_heads=1, head_dim=32, tie_word_embeddings=True, qkv_bias=True,
                         o_bias=True, qk_norm=True, rope=RopeConfig("default", 1000000.0))


def model_weights(cfg: ModelConfig, dtype=torch.float32, device="cpu", seed: int = 0):
    """Random weights whose norms and biases are random too (random_weights sets norms to one)."""
    w = random_weights(cfg, device, dtype, seed)
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    for lw in w.layers:
        for t in (lw.input_norm, lw.post_norm, lw.q_norm, lw.k_norm, lw.qkv_bias, lw.o_bias):
            if t is not None:
                t.add_((torch.randn(t.shape, generator=gen, device=device) * 0.1).to(dtype))
    return w


def backends(cfg: ModelConfig, weights, max_num_seqs: int, block_size: int = 4, blocks: int = 128,
             max_context: int = 256, device="cpu", **plan):
    dtype = str(weights.embed.dtype).removeprefix("torch.")
    layout = KVCacheLayout(cfg.num_layers, blocks, block_size, cfg.num_kv_heads, cfg.head_dim, dtype)
    ref = TorchBackend(cfg, weights, layout, device, max_context)
    if device != "cpu":     # a GPU run tests the plan WARPLOOP_MK_PLAN names (scripts/device_mk.sh), if any
        from warploop.llm.mk.plans import env_options
        plan = {**env_options(), **plan}
    plan.setdefault("graph_rows", 0)     # every batch on the graph (a GPU's default leaves batches per op)
    if device == "cpu":                  # the interpreter on CI's 2 loaded cores ran a big graph's step for over
        plan.setdefault("timeout", 300.0)   # the default 60 s watchdog (Plan.timeout); a hang still ends the test
    mk = MegakernelBackend(cfg, weights, layout, device, max_context, **plan)
    ref.warmup(max_num_seqs)
    mk.warmup(max_num_seqs)
    return ref, mk


def run_steps(ref, mk, prompts: list[list[int]], steps: int, block_size: int = 4, seed: int = 0):
    """Prefill `prompts` on both backends, then decode `steps` greedy steps together, feeding both
    the per-op backend's tokens. Returns [(mk logits, ref logits, the graph's own argmax)] per step,
    each step's own logits (copied, whatever buffer a backend returns them in).
    Block tables are scattered (a permutation of the pool), so paging is exercised."""
    order = torch.randperm(ref.layout.num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    tables, lens = [], [len(p) for p in prompts]
    for n in lens:
        need = -(-(n + steps) // block_size)
        tables.append(order[:need])
        order = order[need:]
    prefill = ModelBatch([t for p in prompts for t in p], [i for p in prompts for i in range(len(p))], lens[:],
                         lens[:], tables)
    tokens = ref.forward(prefill).argmax(-1)
    mk.forward(prefill)
    out = []
    for _ in range(steps):
        batch = ModelBatch(tokens.tolist(), lens[:], [1] * len(lens), [n + 1 for n in lens], tables)
        # clones: the per-op backend's CUDA-graph replay returns a view of its static output
        # buffer, which the next step overwrites (the Backend contract: valid until the next forward)
        got, want = mk.forward(batch).clone(), ref.forward(batch).clone()
        out.append((got, want, mk.last_greedy_tokens()))
        tokens, lens = want.argmax(-1), [n + 1 for n in lens]
    return out
