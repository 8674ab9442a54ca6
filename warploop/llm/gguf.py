"""GGUF model files (llama.cpp, Ollama): config, weights and tokenizer from one file.

Read with the `gguf` package that the llama.cpp project publishes (`pip install 'warploop[gguf]'`).
Quantized tensors are dequantized once, at load, to the engine's dtype (bf16 by default); the engine
then runs exactly as on a Hugging Face checkpoint. The metadata becomes a config.json-style dict for
ModelConfig, the tensors are renamed to Hugging Face names for `fuse`, and the vocabulary, merges,
special tokens and chat template become a `tokenizers` tokenizer.

llama.cpp's converter stores Llama's q and k projections with each head's rows interleaved (GGML's
rope rotates adjacent pairs; Hugging Face's rotates halves); they are put back here. Qwen2/Qwen3 use
the half-rotation in both and are stored as they are.
"""
from __future__ import annotations

from pathlib import Path

from warploop.llm.config import ConfigError, ModelConfig

# GGUF general.architecture -> the Hugging Face architecture ModelConfig reads.
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
# What gguf's dequantizer reads and llama.cpp / Ollama files commonly hold.
QUANT_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
# tokenizer.ggml.pre -> the pre-tokenizer's split regexes, applied in order (llama.cpp's llama-vocab.cpp).
GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
PRE_TOKENIZERS = {
    "default": [GPT2_SPLIT], "gpt2": [GPT2_SPLIT],
    "llama-bpe": [r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+"],
    "qwen2": [r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+"],
    "smollm": [r"\p{N}", GPT2_SPLIT],
}
# Llama 3's tokenizer takes a whole pre-token from the vocabulary before trying merges (llama.cpp's ignore_merges).
IGNORE_MERGES = {"llama-bpe"}
TOKEN_CONTROL, TOKEN_USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values that mark special tokens


class GGUFError(ValueError):
    """The GGUF file holds something this engine cannot run; the message lists what it can."""


def find_gguf(model: str) -> Path | None:
    """The .gguf file `--model` names: the file itself, or the only one in a directory that has no
    config.json (a Hugging Face directory is loaded as such even if a .gguf lies beside it)."""
    path = Path(model).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise GGUFError(f"--model {model}: no such file")
        return path
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    files = sorted(path.glob("*.gguf"))
    if len(files) > 1:
        raise GGUFError(f"--model {model}: holds {len(files)} .gguf files ({', '.join(f.name for f in files)}); "
                        "pass the one to load")
    return files[0] if files else None


class GGUFModel:
    """One GGUF file: `config`, `tokenizer()` and `load_weights(device, dtype)`."""

    def __init__(self, path: str | Path) -> None:
        try:
            import gguf
        except ImportError:
            raise GGUFError(f"{path}: reading GGUF files needs the gguf package: pip install 'warploop[gguf]'") \
                from None
        self.path = Path(path)
        try:
            self.reader = gguf.GGUFReader(str(self.path))
        except (ValueError, OSError) as e:
            raise GGUFError(f"{self.path} is not a readable GGUF file: {e}") from None
        self.tensors = {t.name: t for t in self.reader.tensors}
        self.arch = self.field("general.architecture")
        if self.arch not in ARCHITECTURES:
            raise GGUFError(f"{self.path.name}: architecture {self.arch!r} is not supported; "
                            f"supported: {', '.join(ARCHITECTURES)}")
        bad = sorted({t.tensor_type.name for t in self.reader.tensors} - set(QUANT_TYPES))
        if bad:
            raise GGUFError(f"{self.path.name}: tensor type(s) {', '.join(bad)} are not supported; "
                            f"supported: {', '.join(QUANT_TYPES)}")
        try:
            self.config = ModelConfig.from_dict(self.hf_config())
        except ConfigError as e:
            raise GGUFError(f"{self.path.name}: {e}") from None

    def field(self, key: str, default=None):
        f = self.reader.fields.get(key)
        return default if f is None else f.contents()

    def hf_config(self) -> dict:
        """The metadata as a config.json would say it."""
        a = self.arch
        heads = int(self.field(f"{a}.attention.head_count"))
        hidden = int(self.field(f"{a}.embedding_length"))
        tokens = self.field("tokenizer.ggml.tokens") or []
        raw = {
            "architectures": [ARCHITECTURES[a]], "hidden_act": "silu",
            "hidden_size": hidden, "num_hidden_layers": int(self.field(f"{a}.block_count")),
            "intermediate_size": int(self.field(f"{a}.feed_forward_length")),
            "num_attention_heads": heads, "num_key_value_heads": int(self.field(f"{a}.attention.head_count_kv", heads)),
            "head_dim": int(self.field(f"{a}.attention.key_length", hidden // heads)),
            "rms_norm_eps": float(self.field(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)),
            "max_position_embeddings": int(self.field(f"{a}.context_length", 2048)),
            "vocab_size": int(self.field(f"{a}.vocab_size", len(tokens))),
            "tie_word_embeddings": "output.weight" not in self.tensors,
            "attention_bias": a == "llama" and "blk.0.attn_q.bias" in self.tensors,
            "rope_parameters": self._rope(), "dtype": "bfloat16",
            "bos_token_id": self.field("tokenizer.ggml.bos_token_id"),
            "eos_token_id": [i for i in (self.field("tokenizer.ggml.eos_token_id"),
                                         self.field("tokenizer.ggml.eot_token_id")) if i is not None],
        }
        return raw

    def _rope(self) -> dict:
        a = self.arch
        theta = float(self.field(f"{a}.rope.freq_base", 10000.0))
        kind = self.field(f"{a}.rope.scaling.type")
        if kind in (None, "none") and "rope_freqs.weight" not in self.tensors:
            return {"rope_type": "default", "rope_theta": theta}
        if kind == "linear":
            return {"rope_type": "linear", "rope_theta": theta, "factor": float(self.field(f"{a}.rope.scaling.factor"))}
        if kind in (None, "none"):  # Llama 3.1+: llama.cpp stores the llama3 scaling as per-dimension factors
            return self._llama3_rope(theta)
        raise GGUFError(f"{self.path.name}: rope scaling {kind!r} is not supported; supported: none, linear, "
                        "and Llama 3's (rope_freqs)")

    def _llama3_rope(self, theta: float) -> dict:
        """The llama3 parameters that reproduce rope_freqs (Meta's published ones), or an error."""
        import torch

        from warploop.llm.rope import RopeConfig, inv_freq

        factors = torch.from_numpy(self._dequantized("rope_freqs.weight").copy()).float().flatten()
        head_dim = 2 * factors.numel()
        params = {"rope_type": "llama3", "rope_theta": theta, "factor": float(factors.max()), "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
        base = RopeConfig.from_hf({"rope_type": "default", "rope_theta": theta}, 8192)
        scaled = RopeConfig.from_hf(params, 8192)
        implied = inv_freq(base, head_dim)[0] / inv_freq(scaled, head_dim)[0]
        if not torch.allclose(implied.float(), factors, rtol=1e-3):
            raise GGUFError(f"{self.path.name}: rope_freqs.weight does not match Llama 3's rope scaling "
                            "(factor, low 1, high 4, original 8192); other rope scalings are not supported")
        return params

    def _dequantized(self, name: str):
        from gguf.quants import dequantize

        t = self.tensors[name]
        return dequantize(t.data, t.tensor_type)

    def gguf_name(self, hf_name: str) -> str:
        """Hugging Face tensor name -> GGUF tensor name (llama.cpp's tensor map)."""
        if hf_name == "model.embed_tokens.weight":
            return "token_embd.weight"
        if hf_name == "model.norm.weight":
            return "output_norm.weight"
        if hf_name == "lm_head.weight":
            return "output.weight"
        parts = hf_name.split(".")  # model.layers.N.<module>.<proj>.<weight|bias>
        layer, module, kind = parts[2], ".".join(parts[3:-1]), parts[-1]
        return f"blk.{layer}.{_LAYER_NAMES[module]}.{kind}"

    def get(self, hf_name: str):
        """The tensor as float32 on the CPU, in Hugging Face layout."""
        import torch

        name = self.gguf_name(hf_name)
        if name not in self.tensors:
            raise GGUFError(f"{self.path.name} lacks tensor {name} ({hf_name}); the file is incomplete or "
                            "belongs to another architecture")
        w = torch.from_numpy(self._dequantized(name).copy()).float()
        cfg = self.config
        if self.arch == "llama" and hf_name.endswith(("q_proj.weight", "k_proj.weight", "q_proj.bias",
                                                      "k_proj.bias")):
            heads = cfg.num_heads if ".q_proj." in hf_name else cfg.num_kv_heads
            w = _unpermute(w, heads)
        return w

    def load_weights(self, device, dtype, progress: bool = False):
        from warploop.llm.weights import checkpoint_shapes, fuse

        for name, shape in checkpoint_shapes(self.config).items():
            t = self.tensors.get(self.gguf_name(name))
            if t is not None and tuple(reversed([int(n) for n in t.shape])) != shape:
                raise GGUFError(f"{self.path.name}: {t.name} has shape {tuple(reversed(t.shape.tolist()))} but "
                                f"the metadata implies {shape}")
        return fuse(self.config, self.get, device, dtype, progress=progress)

    def tokenizer(self):
        from warploop.llm.tokenizer import Tokenizer

        kind = self.field("tokenizer.ggml.model")
        if kind != "gpt2":
            raise GGUFError(f"{self.path.name}: tokenizer {kind!r} is not supported; supported: gpt2 (byte-level "
                            "BPE, as Llama 3, Qwen2/3 and SmolLM use)")
        tokens = list(self.field("tokenizer.ggml.tokens"))
        types = list(self.field("tokenizer.ggml.token_type") or [1] * len(tokens))
        special = [t for t, k in zip(tokens, types, strict=True) if k in (TOKEN_CONTROL, TOKEN_USER_DEFINED)]
        pre = self.field("tokenizer.ggml.pre", "default")
        if pre not in PRE_TOKENIZERS:
            raise GGUFError(f"{self.path.name}: pre-tokenizer {pre!r} is not supported; supported: "
                            f"{', '.join(PRE_TOKENIZERS)}")
        tok = _bpe(tokens, list(self.field("tokenizer.ggml.merges") or []), special, PRE_TOKENIZERS[pre],
                   ignore_merges=pre in IGNORE_MERGES)

        def token(key: str) -> str | None:
            i = self.field(f"tokenizer.ggml.{key}_token_id")
            return tokens[i] if i is not None and 0 <= i < len(tokens) else None

        config = {"bos_token": token("bos"), "eos_token": token("eos"), "pad_token": token("padding"),
                  "add_bos_token": bool(self.field("tokenizer.ggml.add_bos_token", False)),
                  "chat_template": self.field("tokenizer.chat_template")}
        return Tokenizer.from_parts(tok, {k: v for k, v in config.items() if v is not None},
                                    set(self.config.eos_token_ids))


_LAYER_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


def _unpermute(w, heads: int):
    """Undo llama.cpp's q/k row order: per head, (rotary pair, half) -> (half, rotary pair)."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _bpe(tokens: list[str], merges: list[str], special: list[str], splits: list[str], ignore_merges: bool):
    """A byte-level BPE `tokenizers.Tokenizer` from the GGUF vocabulary."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    model = models.BPE(vocab={t: i for i, t in enumerate(tokens)},
                       merges=[tuple(m.split(" ", 1)) for m in merges], ignore_merges=ignore_merges)
    tok = Tokenizer(model)
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    return tok
