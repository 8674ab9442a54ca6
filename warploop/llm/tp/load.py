"""One rank's weights, read slice by slice from the safetensors files (safe_open + get_slice), so no
rank ever reads, let alone holds, the whole model; or random ones of the same shapes (benchmarks).
"""
from __future__ import annotations

from pathlib import Path

from warploop.llm.config import ModelConfig
from warploop.llm.loader import ModelLoadError, safetensors_files
from warploop.llm.tp.shard import Slice, local_config, slices
from warploop.llm.weights import ModelWeights, checkpoint_shapes, fuse, random_weights


def open_checkpoint(path: Path, cfg: ModelConfig) -> dict[str, object]:
    """tensor name -> its open safetensors handle, after checking every name and shape `cfg` implies."""
    from safetensors import safe_open

    where: dict[str, object] = {}
    for file in safetensors_files(path):
        try:
            handle = safe_open(str(file), framework="pt", device="cpu")
        except Exception as e:  # safetensors raises its own error types for truncated headers
            raise ModelLoadError(f"cannot read {file}: {e}") from None
        where.update(dict.fromkeys(handle.keys(), handle))
    for name, shape in checkpoint_shapes(cfg).items():
        if name not in where:
            raise ModelLoadError(f"the checkpoint in {path} lacks {name}; the weights are incomplete or belong "
                                 "to another architecture")
        actual = tuple(where[name].get_slice(name).get_shape())
        if actual != shape:
            raise ModelLoadError(f"{name} has shape {actual} in the checkpoint but config.json implies {shape}; "
                                 f"the config and the weights in {path} do not match")
    return where


def read_slice(handle, name: str, part: Slice | None):
    """The CPU tensor `part` of `name` (zero rows appended up to part.size)."""
    import torch

    view = handle.get_slice(name)
    if part is None:
        return view[:]
    tensor = view[part.start:part.stop] if part.dim == 0 else view[:, part.start:part.stop]
    missing = part.size - (part.stop - part.start)
    if missing:
        tensor = torch.cat([tensor, tensor.new_zeros((missing, *tensor.shape[1:]))])
    return tensor


def load_shard(path: str | Path, cfg: ModelConfig, n: int, rank: int, device, dtype) -> ModelWeights:
    """Rank `rank` of `n`: its slice of every tensor, fused as the backend wants them, on `device`."""
    where = open_checkpoint(Path(path), cfg)
    plan = slices(cfg, n, rank)
    weights = fuse(local_config(cfg, n), lambda name: read_slice(where[name], name, plan[name]), device, dtype)
    return _drop_row_biases(weights, rank)


def random_shard(cfg: ModelConfig, n: int, rank: int, device, dtype, seed: int = 0) -> ModelWeights:
    """Random weights of rank `rank`'s shapes, built on `device` (benchmarks: no checkpoint needed)."""
    return _drop_row_biases(random_weights(local_config(cfg, n), device, dtype, seed + rank), rank)


def _drop_row_biases(weights: ModelWeights, rank: int) -> ModelWeights:
    """o_proj and down_proj biases are added once, by rank 0: the all-reduce would count them N times."""
    if rank:
        for layer in weights.layers:
            layer.o_bias = layer.down_bias = None
    return weights


def stream_shard(path: str | Path | None, cfg: ModelConfig, n: int, rank: int, device, dtype):
    """Rank `rank`'s weights for the streaming decoder's tensor parallelism, which the per-op backend
    shares (its layers and vocabulary shards): load_shard's from the checkpoint at `path`, or, random,
    one full model on every rank (the same seed) sharded, so every rank holds a share of one model."""
    from warploop.llm.tp.shard import shard_weights
    if path is None:
        return shard_weights(random_weights(cfg, device, dtype, seed=0), cfg, n, rank)
    return load_shard(path, cfg, n, rank, device, dtype)
