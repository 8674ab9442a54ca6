"""A model directory as other tools write one, for a model shape with random weights: config.json
(HF keys, by family), a byte-level tokenizer (tests/llm_helpers.py) and bf16 safetensors, one file per
4 layers. Device scripts serve and load these where no real checkpoint can be fetched.

    from checkpoint import write_checkpoint      # scripts/ on sys.path
    write_checkpoint(Path("/tmp/m"), LLAMA_3_2_1B, "cuda")
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))     # tests.llm_helpers: the tokenizer

from warploop.llm.config import ModelConfig

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def hf_config(cfg: ModelConfig) -> dict:
    """config.json for `cfg`, the keys transformers writes for its family."""
    rope = cfg.rope
    scaling = None
    if rope.rope_type == "llama3":
        scaling = {"rope_type": "llama3", "factor": rope.factor, "low_freq_factor": rope.low_freq_factor,
                   "high_freq_factor": rope.high_freq_factor,
                   "original_max_position_embeddings": rope.original_max_position_embeddings}
    elif rope.rope_type != "default":
        raise ValueError(f"rope_type {rope.rope_type!r}: only default and llama3 are written here")
    out = {"architectures": [ARCHITECTURES[cfg.family]], "model_type": cfg.family, "vocab_size": cfg.vocab_size,
           "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
           "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
           "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "rms_norm_eps": cfg.rms_norm_eps,
           "max_position_embeddings": cfg.max_position_embeddings, "tie_word_embeddings": cfg.tie_word_embeddings,
           "hidden_act": "silu", "dtype": cfg.dtype, "rope_theta": rope.theta, "rope_scaling": scaling,
           "eos_token_id": cfg.eos_token_ids[0] if cfg.eos_token_ids else None, "bos_token_id": cfg.bos_token_id}
    if cfg.family == "qwen3":
        out["attention_bias"] = False
    return out


def write_checkpoint(path: Path, cfg: ModelConfig, device: str = "cpu") -> None:
    """config.json, a byte-level tokenizer and random bf16 weights (norms 1, the rest N(0, 0.02))."""
    import torch
    from safetensors.torch import save_file

    from tests.llm_helpers import save_tokenizer
    from warploop.llm.weights import checkpoint_shapes

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(hf_config(cfg), indent=1))
    save_tokenizer(path)
    gen = torch.Generator(device=device).manual_seed(0)
    groups: dict[str, dict] = {}
    for name, shape in checkpoint_shapes(cfg).items():
        layer = name.split(".")[2] if name.startswith("model.layers.") else "head"
        key = "head" if layer == "head" else f"{int(layer) // 4:02d}"
        t = torch.ones(shape, device=device, dtype=torch.bfloat16) if name.endswith("norm.weight") else \
            torch.randn(shape, device=device, generator=gen).mul_(0.02).to(torch.bfloat16)
        groups.setdefault(key, {})[name] = t.cpu()
    for key, tensors in groups.items():
        save_file(tensors, str(path / f"model-{key}.safetensors"))
