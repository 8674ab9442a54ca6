"""Rotary position embeddings: the inverse frequencies for each scaling scheme, and the cos/sin table.

The formulas follow transformers' `modeling_rope_utils` (default, linear, llama3, yarn) so that
logits match it to float32 rounding; the table is computed in float32 like transformers does.
"""
from __future__ import annotations

import dataclasses
import math

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    rope_type: str = "default"
    theta: float = 10000.0
    factor: float = 1.0
    low_freq_factor: float = 1.0             # llama3
    high_freq_factor: float = 4.0            # llama3
    original_max_position_embeddings: int | None = None   # llama3, yarn
    attention_factor: float | None = None    # yarn
    beta_fast: float = 32.0                  # yarn
    beta_slow: float = 1.0                   # yarn
    mscale: float | None = None              # yarn
    mscale_all_dim: float | None = None      # yarn
    truncate: bool = True                    # yarn

    def __post_init__(self) -> None:
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"rope_type {self.rope_type!r} is not supported; supported: "
                             f"{', '.join(SUPPORTED_ROPE_TYPES)}")
        if self.rope_type in ("llama3", "yarn") and self.original_max_position_embeddings is None:
            raise ValueError(f"rope_type {self.rope_type!r} needs original_max_position_embeddings in the config")

    @classmethod
    def from_hf(cls, params: dict, max_position_embeddings: int) -> RopeConfig:
        """From a transformers 5.x `rope_parameters` dict (4.x `rope_scaling` plus `rope_theta` merged in)."""
        rope_type = params.get("rope_type") or params.get("type") or "default"
        factor = params.get("factor")
        original = params.get("original_max_position_embeddings")
        if rope_type == "yarn" and factor is None and original:
            factor = max_position_embeddings / original
        return cls(rope_type=rope_type, theta=float(params.get("rope_theta", 10000.0)),
                   factor=float(factor if factor is not None else 1.0),
                   low_freq_factor=float(params.get("low_freq_factor", 1.0)),
                   high_freq_factor=float(params.get("high_freq_factor", 4.0)),
                   original_max_position_embeddings=original, attention_factor=params.get("attention_factor"),
                   beta_fast=float(params.get("beta_fast") or 32.0), beta_slow=float(params.get("beta_slow") or 1.0),
                   mscale=params.get("mscale"), mscale_all_dim=params.get("mscale_all_dim"),
                   truncate=bool(params.get("truncate", True)))


def inv_freq(rope: RopeConfig, head_dim: int):
    """(inverse frequencies [head_dim // 2] float32, attention scaling applied to cos and sin)."""
    import torch

    dim = head_dim
    base = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim
    freq = 1.0 / (rope.theta ** base)
    if rope.rope_type == "default":
        return freq, 1.0
    if rope.rope_type == "linear":
        return freq / rope.factor, 1.0
    if rope.rope_type == "llama3":
        return _llama3(freq, rope), 1.0
    return _yarn(rope, dim)


def _llama3(freq, rope: RopeConfig):
    import torch

    old = rope.original_max_position_embeddings
    low_wavelen = old / rope.low_freq_factor
    high_wavelen = old / rope.high_freq_factor
    wavelen = 2 * math.pi / freq
    scaled = torch.where(wavelen > low_wavelen, freq / rope.factor, freq)
    smooth = (old / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(rope: RopeConfig, dim: int):
    import torch

    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = rope.attention_factor
    if attention is None:
        if rope.mscale and rope.mscale_all_dim:
            attention = get_mscale(rope.factor, rope.mscale) / get_mscale(rope.factor, rope.mscale_all_dim)
        else:
            attention = get_mscale(rope.factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(rope.original_max_position_embeddings / (rotations * 2 * math.pi))) / (
            2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers avoids the same singularity this way
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = rope.theta ** (torch.arange(0, dim, 2).to(torch.float) / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (rope.factor * pos_freqs)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep, float(attention)


def cos_sin_table(rope: RopeConfig, head_dim: int, max_positions: int, device=None):
    """cos and sin, each [max_positions, head_dim // 2] float32, scaled by the attention factor."""
    import torch

    freq, scale = inv_freq(rope, head_dim)
    angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), freq)
    return (angles.cos() * scale).to(device), (angles.sin() * scale).to(device)
