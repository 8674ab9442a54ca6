"""The decode megakernel on a GPU against the per-op backend (skips without one).

Run on the device machine: scripts/device_mk.sh. A float32 model must give the per-op backend's
greedy tokens exactly; a bf16 one its logits within bf16 noise, at every batch bucket.
"""
import os

import pytest

os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")   # lazy loading synchronises beside a resident kernel

import torch  # noqa: E402
from mk_helpers import LLAMA_GQA, QWEN3_LIKE, backends, model_weights, run_steps  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
BATCHES = (1, 2, 4, 8, 16, 32)


def prompts(n: int) -> list[list[int]]:
    """n prompts of different lengths (1 to ~150 tokens: one or all attention splits in use)."""
    return [[(7 * i + j) % 190 + 1 for j in range(1 + (37 * i) % 150)] for i in range(n)]


@pytest.mark.parametrize("cfg", [LLAMA_GQA, QWEN3_LIKE], ids=["llama_gqa", "qwen3_like"])
def test_fp32_greedy_tokens_equal_per_op_across_batches(cfg):
    ref, mk = backends(cfg, model_weights(cfg, device="cuda"), max_num_seqs=max(BATCHES), blocks=2048,
                       device="cuda")
    try:
        for n in BATCHES:
            for i, (got, want, graph_argmax) in enumerate(run_steps(ref, mk, prompts(n), steps=4, seed=n)):
                assert got.argmax(-1).tolist() == want.argmax(-1).tolist(), f"batch {n} step {i}"
                assert graph_argmax == got.argmax(-1).tolist(), f"batch {n} step {i}: graph argmax"
                assert float((got - want).abs().max() / want.abs().max()) < 1e-3
    finally:
        mk.close()


def test_bf16_logits_close_to_per_op_across_batches():
    cfg = LLAMA_GQA
    ref, mk = backends(cfg, model_weights(cfg, torch.bfloat16, device="cuda"), max_num_seqs=max(BATCHES),
                       blocks=2048, device="cuda")
    try:
        for n in BATCHES:
            for i, (got, want, _) in enumerate(run_steps(ref, mk, prompts(n), steps=4, seed=n)):
                err = float((got - want).abs().max() / want.abs().max())
                assert err < 3e-2, f"batch {n} step {i}: relative error {err:.2e}"
    finally:
        mk.close()
