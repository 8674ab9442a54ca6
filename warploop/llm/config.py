"""ModelConfig: what the engine needs from a Hugging Face config.json, typed and checked.

Reads both transformers 4.x (`rope_theta` + `rope_scaling`) and 5.x (`rope_parameters`) layouts,
`dtype` or `torch_dtype`, and rejects what the engine cannot run (sliding windows, other
activations, unknown architectures) with a message that names the key.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os

from warploop.llm.rope import RopeConfig

# architectures[0] or model_type -> family. The families differ only in biases and q/k norms.
ARCHITECTURES = {
    "LlamaForCausalLM": "llama", "llama": "llama",
    "Qwen2ForCausalLM": "qwen2", "qwen2": "qwen2",
    "Qwen3ForCausalLM": "qwen3", "qwen3": "qwen3",
}
DTYPES = ("float32", "bfloat16", "float16")
MAX_CONFIG_BYTES = 16 << 20


class ConfigError(ValueError):
    """config.json describes a model this engine cannot run, or is malformed."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    family: str                     # llama | qwen2 | qwen3
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False          # qwen2 always; llama/qwen3 when attention_bias
    o_bias: bool = False            # llama/qwen3 when attention_bias
    mlp_bias: bool = False          # llama when mlp_bias
    qk_norm: bool = False           # qwen3: RMSNorm over head_dim on q and k before RoPE
    rope: RopeConfig = dataclasses.field(default_factory=RopeConfig)
    dtype: str | None = None        # the checkpoint's dtype, if the config names it
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.family not in ("llama", "qwen2", "qwen3"):
            raise ConfigError(f"unknown model family {self.family!r}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_attention_heads ({self.num_heads}) must be a multiple of "
                              f"num_key_value_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ConfigError(f"dtype {self.dtype!r} is not supported; use one of {', '.join(DTYPES)}")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def num_parameters(self) -> int:
        d, f, v = self.hidden_size, self.intermediate_size, self.vocab_size
        attn = d * (self.q_size + 2 * self.kv_size) + self.q_size * d
        per_layer = attn + 3 * d * f + 2 * d + (2 * self.head_dim if self.qk_norm else 0)
        per_layer += (self.q_size + 2 * self.kv_size) * self.qkv_bias + d * self.o_bias + (2 * f + d) * self.mlp_bias
        return self.num_layers * per_layer + v * d * (1 if self.tie_word_embeddings else 2) + d

    @classmethod
    def from_dict(cls, raw: dict) -> ModelConfig:
        if not isinstance(raw, dict):
            raise ConfigError(f"config.json must hold a JSON object, got a {type(raw).__name__}")
        archs = raw.get("architectures") or []
        if not isinstance(archs, list):
            raise ConfigError(f"architectures must be a list of class names, got {archs!r}")
        key = archs[0] if archs else raw.get("model_type")
        family = ARCHITECTURES.get(key) or ARCHITECTURES.get(raw.get("model_type"))
        if family is None:
            supported = ", ".join(k for k in ARCHITECTURES if k[0].isupper())
            raise ConfigError(f"unknown architecture {key!r} in config.json; supported: {supported}")
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"hidden_act {act!r} is not supported (only silu)")
        if raw.get("use_sliding_window") or "sliding_attention" in (raw.get("layer_types") or []):
            raise ConfigError("sliding-window attention is not supported; set use_sliding_window to false")
        hidden, heads = _positive_int(raw, "hidden_size"), _positive_int(raw, "num_attention_heads")
        max_pos = _positive_int(raw, "max_position_embeddings", 2048)
        attention_bias = bool(raw.get("attention_bias", False))
        return cls(
            family=family, vocab_size=_positive_int(raw, "vocab_size"), hidden_size=hidden,
            intermediate_size=_positive_int(raw, "intermediate_size"),
            num_layers=_positive_int(raw, "num_hidden_layers"), num_heads=heads,
            num_kv_heads=_positive_int(raw, "num_key_value_heads", heads),
            head_dim=_positive_int(raw, "head_dim", hidden // heads),
            rms_norm_eps=_norm_eps(raw.get("rms_norm_eps", 1e-6)), max_position_embeddings=max_pos,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=family == "qwen2" or attention_bias, o_bias=family != "qwen2" and attention_bias,
            mlp_bias=bool(raw.get("mlp_bias", False)), qk_norm=family == "qwen3",
            rope=_rope(raw, max_pos), dtype=_dtype(raw), eos_token_ids=_ids(raw.get("eos_token_id")),
            bos_token_id=raw.get("bos_token_id") if isinstance(raw.get("bos_token_id"), int) else None)

    @classmethod
    def from_dir(cls, path: str) -> ModelConfig:
        file = os.path.join(path, "config.json")
        if not os.path.isfile(file):
            raise FileNotFoundError(f"{file} does not exist: a model directory needs the Hugging Face config.json "
                                    "next to its .safetensors weights")
        if os.path.getsize(file) > MAX_CONFIG_BYTES:
            raise ConfigError(f"{file} is {os.path.getsize(file)} bytes; a config.json is a few KB: replace it")
        try:
            with open(file, encoding="utf-8") as f:
                raw = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{file} is not valid JSON: {e}") from None
        try:
            return cls.from_dict(raw)
        except ConfigError as e:
            raise ConfigError(f"{file}: {e}") from None


def _positive_int(raw: dict, key: str, default: int | None = None) -> int:
    """raw[key] as a positive int; `default` when absent or null (None: the key is required)."""
    value = raw.get(key)
    if value is None and default is not None:
        return default
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # some exporters write 4096.0
    if key not in raw:
        raise ConfigError(f"config.json lacks {key!r}")
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{key} must be a positive integer, got {value!r}; fix it in config.json")
    return value


def _norm_eps(value) -> float:
    # A negative or NaN epsilon loads, then turns every RMSNorm into NaN: refuse it here.
    if not isinstance(value, int | float) or isinstance(value, bool) or not (math.isfinite(value) and 0 < value < 1):
        raise ConfigError(f"rms_norm_eps must be a finite number in (0, 1), got {value!r}; fix it in config.json "
                          "(1e-5 or 1e-6 for the supported families)")
    return float(value)


def _rope(raw: dict, max_pos: int) -> RopeConfig:
    params = raw.get("rope_parameters")
    if params is None:  # transformers 4.x layout
        scaling = raw.get("rope_scaling") or {}
        if not isinstance(scaling, dict):
            raise ConfigError(f"rope_scaling must be a JSON object or null, got {scaling!r}")
        params = {**scaling, "rope_theta": raw.get("rope_theta", 10000.0)}
    elif isinstance(params, dict) and "full_attention" in params:  # 5.x per-layer-type layout
        params = params["full_attention"]
    if not isinstance(params, dict):
        raise ConfigError(f"rope_parameters must be a JSON object, got {params!r}")
    try:
        if float(params.get("partial_rotary_factor", 1.0)) != 1.0:
            raise ConfigError("partial_rotary_factor other than 1.0 is not supported")
        return RopeConfig.from_hf(params, max_pos)
    except ConfigError:
        raise
    except (ValueError, TypeError) as e:
        raise ConfigError(f"rope parameters: {e}") from None


def _dtype(raw: dict) -> str | None:
    value = raw.get("dtype") or raw.get("torch_dtype")
    if value is None:
        return None
    value = str(value).removeprefix("torch.")
    return {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "float": "float32", "fp32": "float32"}.get(
        value, value)


def _ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    values = [value] if isinstance(value, int) else value
    if not isinstance(values, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ConfigError(f"eos_token_id must be an integer or a list of integers, got {value!r}")
    return tuple(values)
