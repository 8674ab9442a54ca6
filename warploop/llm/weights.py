"""The model's weights as the backend uses them: q/k/v and gate/up fused, one dataclass per layer.

`checkpoint_shapes` names every tensor a Hugging Face checkpoint must hold for a config, with its
shape; the loader checks a checkpoint against it and `fuse` builds the weights from its tensors.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

from warploop.llm.config import ModelConfig

# Every weight starts at a multiple of this many bytes: the kernels declare their weight pointers
# ':16' (warploop.runtime.tasks.ALIGN) and Triton specializes on it. A tensor memory-mapped from a
# file starts wherever the file's header put it (safetensors: 8 + header bytes), so `fuse` copies the
# ones that do not; a tensor converted or moved to another device is a fresh, aligned allocation.
WEIGHT_ALIGN_BYTES = 16


@dataclasses.dataclass
class LayerWeights:
    input_norm: object            # [hidden]
    qkv: object                   # [q_size + 2 * kv_size, hidden]
    qkv_bias: object | None
    o: object                     # [hidden, q_size]
    o_bias: object | None
    post_norm: object             # [hidden]
    gate_up: object               # [2 * intermediate, hidden]
    gate_up_bias: object | None
    down: object                  # [hidden, intermediate]
    down_bias: object | None
    q_norm: object | None         # [head_dim] (qwen3)
    k_norm: object | None


@dataclasses.dataclass
class ModelWeights:
    embed: object                 # [vocab, hidden]
    layers: list[LayerWeights]
    norm: object                  # [hidden]
    lm_head: object               # [vocab, hidden]; the embedding itself when tied


def checkpoint_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor name a Hugging Face checkpoint of this config holds, and its shape."""
    d, f, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, d), "model.norm.weight": (d,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, d)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
            p + "self_attn.q_proj.weight": (cfg.q_size, d), p + "self_attn.k_proj.weight": (cfg.kv_size, d),
            p + "self_attn.v_proj.weight": (cfg.kv_size, d), p + "self_attn.o_proj.weight": (d, cfg.q_size),
            p + "mlp.gate_proj.weight": (f, d), p + "mlp.up_proj.weight": (f, d), p + "mlp.down_proj.weight": (d, f),
        })
        if cfg.qkv_bias:
            shapes.update({p + "self_attn.q_proj.bias": (cfg.q_size,), p + "self_attn.k_proj.bias": (cfg.kv_size,),
                           p + "self_attn.v_proj.bias": (cfg.kv_size,)})
        if cfg.o_bias:
            shapes[p + "self_attn.o_proj.bias"] = (d,)
        if cfg.mlp_bias:
            shapes.update({p + "mlp.gate_proj.bias": (f,), p + "mlp.up_proj.bias": (f,),
                           p + "mlp.down_proj.bias": (d,)})
        if cfg.qk_norm:
            shapes.update({p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)})
    return shapes


def fuse(cfg: ModelConfig, get: Callable[[str], object], device, dtype, progress: bool = False,
         check_finite: bool = False) -> ModelWeights:
    """Build ModelWeights from `get(name)` (CPU tensors with the checkpoint_shapes names).

    Every tensor of the result starts at a multiple of WEIGHT_ALIGN_BYTES (only those that did not
    are copied), whatever file layout `get` reads and whichever backend runs them.
    With `check_finite`, ValueError names every tensor holding a NaN or an infinity once converted
    to `dtype` (a float32 value past float16's range becomes one).
    """
    import torch

    sums: list[tuple[str, object]] = []   # device-side sums, read back once at the end: one sync

    def put(t, name):
        t = t.to(device=device, dtype=dtype).contiguous()
        if t.data_ptr() % WEIGHT_ALIGN_BYTES:
            t = t.clone()  # a fresh allocation: the allocators of torch's devices align far past 16 bytes
        if check_finite:
            sums.append((name, t.sum(dtype=torch.float32)))  # NaN or inf anywhere makes the sum non-finite
        return t

    def cat(*names):
        return put(torch.cat([get(n) for n in names]), " / ".join(names))

    def one(name):
        return put(get(name), name)

    def maybe(flag, *names):
        return (cat(*names) if len(names) > 1 else one(names[0])) if flag else None

    layers = []
    for i in _progress(range(cfg.num_layers), progress):
        p = f"model.layers.{i}."
        a, m = p + "self_attn.", p + "mlp."
        layers.append(LayerWeights(
            input_norm=one(p + "input_layernorm.weight"),
            qkv=cat(a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"),
            qkv_bias=maybe(cfg.qkv_bias, a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"),
            o=one(a + "o_proj.weight"), o_bias=maybe(cfg.o_bias, a + "o_proj.bias"),
            post_norm=one(p + "post_attention_layernorm.weight"),
            gate_up=cat(m + "gate_proj.weight", m + "up_proj.weight"),
            gate_up_bias=maybe(cfg.mlp_bias, m + "gate_proj.bias", m + "up_proj.bias"),
            down=one(m + "down_proj.weight"), down_bias=maybe(cfg.mlp_bias, m + "down_proj.bias"),
            q_norm=maybe(cfg.qk_norm, a + "q_norm.weight"), k_norm=maybe(cfg.qk_norm, a + "k_norm.weight")))
    embed = one("model.embed_tokens.weight")
    lm_head = embed if cfg.tie_word_embeddings else one("lm_head.weight")
    weights = ModelWeights(embed=embed, layers=layers, norm=one("model.norm.weight"), lm_head=lm_head)
    if sums:
        finite = torch.isfinite(torch.stack([s for _, s in sums])).tolist()
        bad = [name for (name, _), ok in zip(sums, finite, strict=True) if not ok]
        if bad:
            more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
            raise ValueError(f"{', '.join(bad[:3])}{more} hold NaN or infinite values once converted to "
                             f"{str(dtype).removeprefix('torch.')}; the checkpoint is corrupt (download it again) "
                             "or exceeds this dtype's range (load it in bfloat16 or float32)")
    return weights


def random_weights(cfg: ModelConfig, device, dtype, seed: int = 0) -> ModelWeights:
    """Random weights built on `device` (benchmarks: no checkpoint, no host round trip)."""
    import torch

    gen = torch.Generator(device=device).manual_seed(seed)
    shapes = checkpoint_shapes(cfg)

    def get(name):
        if name.endswith("norm.weight"):
            return torch.ones(shapes[name], device=device, dtype=dtype)
        return torch.randn(shapes[name], device=device, dtype=torch.float32, generator=gen).mul_(0.02).to(dtype)

    return fuse(cfg, get, device, dtype)


def _progress(items, enabled: bool):
    import sys

    if not enabled or not sys.stderr.isatty():  # a bar only on a terminal, never into a log file
        return items
    from tqdm import tqdm

    return tqdm(items, desc="loading layers", unit="layer", leave=False)
