"""Write the embedded tiny model as a GGUF file the way llama.cpp's converter lays one out, with gguf's writer.

Used by test_gguf.py. Which tensors get which type is the caller's: Q8_0 and F16 for matrices here,
F32 for norms (as llama.cpp keeps them). As `qwen2` or `qwen3` the same weights go in unpermuted, with
zero q/k/v biases (qwen2) or unit q/k norms (qwen3) added, so those loaders run on a known model.
"""
from __future__ import annotations

import json
from pathlib import Path

TINY = Path(__file__).resolve().parents[1] / "warploop" / "llm" / "tiny"
# llama.cpp's tensor names, written out here independently of warploop/llm/gguf.py so the test checks it.
LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
         "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
         "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
         "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def gguf_name(hf: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    if hf in top:
        return top[hf]
    parts = hf.split(".")
    return f"blk.{parts[2]}.{LAYER['.'.join(parts[3:-1])]}.{parts[-1]}"


def permute(w, heads: int):
    """llama.cpp's q/k row order for GGML's pairwise rope."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(path: Path, matrix_type: dict[str, str], arch: str = "llama", pre: str = "default",
                    rope_freqs=None) -> Path:
    """`matrix_type`: GGUF tensor-name suffix (e.g. "attn_q.weight") -> type name; other matrices Q8_0.
    `rope_freqs`: per-dimension rope divisors, stored as llama.cpp stores Llama 3's rope scaling."""
    import gguf

    cfg = json.loads((TINY / "config.json").read_text())
    tok = json.loads((TINY / "tokenizer.json").read_text())
    tok_cfg = json.loads((TINY / "tokenizer_config.json").read_text())
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_rope_dimension_count(cfg["head_dim"])
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    vocab = {**tok["model"]["vocab"], **{t["content"]: t["id"] for t in tok["added_tokens"]}}
    tokens = sorted(vocab, key=vocab.get)
    special = {t["content"] for t in tok["added_tokens"] if t["special"]}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens])
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in tok["model"]["merges"]])
    w.add_bos_token_id(vocab[tok_cfg["bos_token"]])
    w.add_eos_token_id(vocab[tok_cfg["eos_token"]])
    w.add_pad_token_id(vocab[tok_cfg["pad_token"]])
    w.add_add_bos_token(bool(tok_cfg["add_bos_token"]))
    w.add_chat_template(tok_cfg["chat_template"])
    generation = json.loads((TINY / "generation_config.json").read_text())
    w.add_eot_token_id(max(generation["eos_token_id"]))  # <|im_end|>: the end of a chat turn
    for name, value in _tensors(cfg, arch).items():
        if ".self_attn.q_proj." in name and arch == "llama":
            value = permute(value, cfg["num_attention_heads"])
        if ".self_attn.k_proj." in name and arch == "llama":
            value = permute(value, cfg["num_key_value_heads"])
        out = gguf_name(name)
        kind = "F32" if value.ndim == 1 else next((t for s, t in matrix_type.items() if out.endswith(s)), "Q8_0")
        qtype = gguf.GGMLQuantizationType[kind]
        data = gguf.quants.quantize(value, qtype) if kind != "F32" else value
        w.add_tensor(out, data, raw_dtype=qtype if kind != "F32" else None)
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _tensors(cfg: dict, arch: str) -> dict:
    import numpy as np
    from safetensors.torch import load_file

    out = {k: v.float().numpy() for k, v in load_file(str(TINY / "model.safetensors")).items()}  # bf16 on disk
    d, heads, kv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}.self_attn."
        if arch == "qwen2":
            for proj, rows in (("q_proj", heads * d), ("k_proj", kv * d), ("v_proj", kv * d)):
                out[f"{p}{proj}.bias"] = np.zeros(rows, np.float32)
        if arch == "qwen3":
            out[f"{p}q_norm.weight"] = out[f"{p}k_norm.weight"] = np.ones(d, np.float32)
    return out
