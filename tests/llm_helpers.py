"""Shared by the tests/test_llm_*.py files: tiny random-weight Hugging Face model directories.

Each directory is what `save_pretrained` writes (fp32), plus a byte-level tokenizer (256 byte
tokens, <s>, </s>) with a tokenizer_config.json carrying a chat template.
"""
from __future__ import annotations

import json
from pathlib import Path

VOCAB = 258
BOS, EOS = 256, 257
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 64}

SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6,
             bos_token_id=BOS, eos_token_id=EOS)


def hf_config(family: str, tied: bool = False, **overrides):
    """A transformers config object for a tiny model of `family` (llama, llama3, qwen2, qwen3)."""
    import transformers

    kw = dict(SMALL, tie_word_embeddings=tied, **overrides)
    if family == "llama3":
        kw.setdefault("rope_parameters", {"rope_theta": 500000.0, **LLAMA3_SCALING})
        return transformers.LlamaConfig(**kw)
    cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config}
    return cls[family](**kw)


def save_model(path: Path, config, seed: int = 0):
    """Build the model with random weights (fp32), save it with its tokenizer; returns the HF model."""
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # transformers initialises norms to 1 and biases to 0: make them matter
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path)
    save_tokenizer(path)
    return model


def save_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    vocab.update({"<s>": BOS, "</s>": EOS})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<s>", "</s>"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", BOS)])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": {"content": "</s>", "special": True}, "chat_template": CHAT_TEMPLATE}))


def make_model_dir(tmp_path: Path, family: str = "llama", tied: bool = False, seed: int = 0, **overrides):
    """(directory, HF model) for a fresh random tiny model."""
    path = tmp_path / f"{family}-{'tied' if tied else 'untied'}-{seed}"
    path.mkdir(parents=True, exist_ok=True)
    model = save_model(path, hf_config(family, tied, **overrides), seed)
    return path, model


def engine_for(path, **options):
    """An engine on the CPU, or on the device WARPLOOP_DEVICE names (to run these tests on a GPU)."""
    import os

    from warploop.llm.engine import Engine

    options.setdefault("device", os.environ.get("WARPLOOP_DEVICE") or "cpu")
    options.setdefault("num_kv_blocks", 256)
    options.setdefault("progress", False)
    return Engine.from_model(str(path), **options)
