"""Logits and greedy tokens match transformers for tiny random-weight models of each family (fp32, CPU)."""
from __future__ import annotations

import json

import pytest
import torch
from llm_helpers import BOS, engine_for, make_model_dir

from warploop.llm.backend import ModelBatch
from warploop.llm.build import build_backend
from warploop.llm.loader import load_config, load_weights
from warploop.llm.params import SamplingParams
from warploop.llm.rope import inv_freq

CASES = {
    "llama3-scaling-tied": ("llama3", True, {}),
    "llama-untied": ("llama", False, {}),
    "qwen2-qkv-bias": ("qwen2", False, {}),
    "qwen3-qk-norm-tied": ("qwen3", True, {}),
    "llama-mlp-and-attention-bias": ("llama", False, {"attention_bias": True, "mlp_bias": True}),
}
PROMPT = [BOS] + [(i * 37 + 11) % 256 for i in range(23)]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm(dim=-1) / b.norm(dim=-1)).max().item()


def check_against_hf(path, hf, block_size: int = 4, device: str = "cpu") -> None:
    cfg = load_config(path)
    freq, _ = inv_freq(cfg.rope, cfg.head_dim)
    torch.testing.assert_close(freq, hf.model.rotary_emb.inv_freq.float(), rtol=1e-6, atol=0)

    hf = hf.to(device)
    with torch.no_grad():
        full = hf.generate(torch.tensor([PROMPT], device=device), max_new_tokens=32, min_new_tokens=32,
                           do_sample=False)[0]
        ref = hf(full[None]).logits[0].float()
    weights = load_weights(path, cfg, torch.device(device), torch.float32, progress=False)
    backend, _ = build_backend(cfg, weights, torch.device(device), block_size=block_size, num_kv_blocks=64)
    table = list(range(63, 63 - (len(full) + block_size - 1) // block_size, -1))  # pages out of order
    n = len(PROMPT)
    logits = backend.forward(ModelBatch(PROMPT, list(range(n)), [n], [n], [table], logits_indices=list(range(n))))
    assert rel_err(logits, ref[:n]) <= 1e-4, "prompt logits differ from transformers"
    for pos in range(n, n + 8):  # decode: one token at a time through the paged cache
        step = backend.forward(ModelBatch([int(full[pos])], [pos], [1], [pos + 1], [table]))
        assert rel_err(step, ref[pos:pos + 1]) <= 1e-4, f"decode logits differ at position {pos}"

    with engine_for(path, device=device) as engine:  # on a GPU: Triton kernels and CUDA graphs
        out = engine.generate(PROMPT, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
    assert out.token_ids == full[n:].tolist()
    assert out.finish_reason == "length"


@pytest.mark.parametrize("case", list(CASES))
def test_matches_transformers(tmp_path, case):
    family, tied, extra = CASES[case]
    path, hf = make_model_dir(tmp_path, family, tied, initializer_range=0.3, **extra)
    check_against_hf(path, hf)


def _rewrite_as_transformers4(path, rope_scaling: dict | None) -> None:
    raw = json.loads((path / "config.json").read_text())
    params = raw.pop("rope_parameters")
    raw["rope_theta"] = params["rope_theta"]
    raw["rope_scaling"] = rope_scaling
    raw["torch_dtype"] = raw.pop("dtype", "float32")
    (path / "config.json").write_text(json.dumps(raw))


@pytest.mark.parametrize("family,scaling", [
    ("llama", {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}),
    ("qwen2", {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}),
    ("llama", {"rope_type": "linear", "factor": 2.0}),
])
def test_transformers4_config_layout(tmp_path, family, scaling):
    """rope_theta / rope_scaling (transformers 4.x) read the same as 5.x's rope_parameters."""
    import transformers

    path, _ = make_model_dir(tmp_path, family, initializer_range=0.3)
    _rewrite_as_transformers4(path, scaling)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert load_config(path).rope.rope_type == scaling.get("type", scaling.get("rope_type"))
    check_against_hf(path, hf, block_size=16)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["llama3-scaling-tied", "qwen3-qk-norm-tied", "qwen2-qkv-bias"])
def test_matches_transformers_on_gpu(tmp_path, case):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    family, tied, extra = CASES[case]
    path, hf = make_model_dir(tmp_path, family, tied, initializer_range=0.3, **extra)
    check_against_hf(path, hf, block_size=16, device="cuda")
