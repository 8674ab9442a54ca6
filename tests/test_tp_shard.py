"""Tensor-parallel sharding arithmetic (warploop/llm/tp/shard.py): each rank's slice of every
weight, for GQA head counts that divide the rank count and that do not (KV heads replicated), and
the configurations it refuses."""
from __future__ import annotations

import pytest
import torch

from warploop.llm.config import ModelConfig
from warploop.llm.tp.shard import TensorParallelError, check, kv_heads_of, local_config, slices, vocab_shard
from warploop.llm.weights import checkpoint_shapes


def config(heads: int, kv: int, vocab: int = 1001, inter: int = 96, **flags) -> ModelConfig:
    return ModelConfig(family="qwen3", vocab_size=vocab, hidden_size=32, intermediate_size=inter, num_layers=2,
                       num_heads=heads, num_kv_heads=kv, head_dim=8, **flags)


def take(tensor: torch.Tensor, part) -> torch.Tensor:
    """The reference: what a Slice means, written with plain indexing."""
    if part is None:
        return tensor
    piece = tensor[part.start:part.stop] if part.dim == 0 else tensor[:, part.start:part.stop]
    pad = part.size - piece.shape[part.dim]
    return torch.cat([piece, piece.new_zeros((pad, *piece.shape[1:]))]) if pad else piece


CASES = [  # (heads, kv heads, ranks): kv divisible by ranks, equal, and fewer kv heads than ranks
    (4, 2, 2), (8, 4, 2), (8, 8, 4), (4, 1, 2), (8, 2, 4), (16, 4, 8), (4, 4, 1),
]


@pytest.mark.parametrize("heads,kv,n", CASES)
def test_every_weight_is_covered_and_q_heads_meet_their_kv_heads(heads, kv, n):
    cfg = config(heads, kv, qkv_bias=True, o_bias=True, mlp_bias=True)
    full = {name: torch.randn(shape) for name, shape in checkpoint_shapes(cfg).items()}
    plans = [slices(cfg, n, r) for r in range(n)]
    local = local_config(cfg, n)
    group = heads // kv
    for name, tensor in full.items():
        parts = [take(tensor, plan[name]) for plan in plans]
        kind = name.rsplit(".", 2)[-2]
        if kind in ("k_proj", "v_proj"):
            owners = {kv_heads_of(cfg, n, r).start: parts[r] for r in range(n)}   # one copy per distinct head set
            assert torch.equal(torch.cat([owners[k] for k in sorted(owners)]), tensor)
            assert all(p.shape[0] == local.num_kv_heads * cfg.head_dim for p in parts)
        elif kind in ("o_proj", "down_proj") and name.endswith("weight"):
            assert torch.equal(torch.cat(parts, dim=1), tensor)
        elif kind in ("embed_tokens", "lm_head"):
            assert all(p.shape[0] == vocab_shard(cfg, n) for p in parts)
            joined = torch.cat(parts)
            assert torch.equal(joined[:cfg.vocab_size], tensor) and not joined[cfg.vocab_size:].any()
        elif kind in ("q_proj", "gate_proj", "up_proj"):
            assert torch.equal(torch.cat(parts), tensor)
            assert parts[0].shape[0] == tensor.shape[0] // n
        else:   # norms and the row-parallel biases: whole on every rank
            assert all(plan[name] is None for plan in plans)
    for r in range(n):
        q_heads = range(r * heads // n, (r + 1) * heads // n)
        assert {h // group for h in q_heads} <= set(kv_heads_of(cfg, n, r))
        assert len(kv_heads_of(cfg, n, r)) == local.num_kv_heads
    assert (local.num_heads, local.intermediate_size) == (heads // n, cfg.intermediate_size // n)


def test_kv_heads_fewer_than_ranks_are_replicated():
    cfg = config(8, 2)
    assert [kv_heads_of(cfg, 4, r) for r in range(4)] == [range(0, 1), range(0, 1), range(1, 2), range(1, 2)]
    assert local_config(cfg, 4).num_kv_heads == 1


@pytest.mark.parametrize("heads,kv,inter,n,words", [
    (6, 2, 96, 4, "6 attention heads"),          # heads % n
    (6, 3, 96, 2, "3 KV heads"),                 # 3 neither splits over nor replicates across 2
    (8, 8, 90, 4, "intermediate_size 90"),
    (4, 2, 96, 0, "at least 1"),
])
def test_refused_with_the_numbers(heads, kv, inter, n, words):
    with pytest.raises(TensorParallelError, match=words) as info:
        check(config(heads, kv, inter=inter), n)
    assert "--tensor-parallel" in str(info.value)


def test_rank_outside_the_group_is_refused():
    with pytest.raises(ValueError, match="rank 2"):
        slices(config(4, 2), 2, 2)


def test_read_slice_matches_indexing(tmp_path):
    """load.read_slice reads rows, columns and padded vocabulary shards straight from the file."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from warploop.llm.tp.load import read_slice

    cfg = config(4, 1, vocab=11)
    tensors = {name: torch.randn(shape) for name, shape in checkpoint_shapes(cfg).items()}
    save_file(tensors, tmp_path / "model.safetensors")
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt", device="cpu") as handle:
        for rank in range(2):
            for name, part in slices(cfg, 2, rank).items():
                assert torch.equal(read_slice(handle, name, part), take(tensors[name], part)), name

