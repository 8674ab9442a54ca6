"""Which slice of every checkpoint tensor each tensor-parallel rank holds.

Megatron-style: q/k/v and gate/up are split by output rows (column-parallel, no communication),
o_proj and down_proj by input columns (row-parallel: each rank's product is a partial sum, added up
by one all-reduce), the embedding and lm_head by vocabulary rows (vocab-parallel; the last shard is
padded with zero rows so every rank's shard has one size). Norms are replicated. A row-parallel
bias would be counted N times by the all-reduce, so only rank 0 keeps it.

Grouped-query attention: with kv_heads >= N each rank owns kv_heads / N KV heads; with kv_heads < N,
N / kv_heads consecutive ranks hold a copy of the same KV head (replication), so a rank's query
heads always attend KV heads it holds. Refused, with the numbers in the message: num_heads % N,
intermediate_size % N, and KV head counts where neither of kv_heads and N divides the other.
"""
from __future__ import annotations

import dataclasses

from warploop.llm.config import ModelConfig
from warploop.llm.kv_cache import cdiv
from warploop.llm.weights import checkpoint_shapes


class TensorParallelError(ValueError):
    """The model cannot be split over this many ranks."""


@dataclasses.dataclass(frozen=True)
class Slice:
    """Rows (dim 0) or columns (dim 1) [start, stop) of a tensor, zero-padded to `size` along dim."""

    dim: int
    start: int
    stop: int
    size: int


def check(cfg: ModelConfig, n: int) -> None:
    """Raise TensorParallelError unless `cfg` splits over `n` ranks."""
    if n < 1:
        raise TensorParallelError(f"--tensor-parallel {n}: must be at least 1")
    h, kv, f = cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size
    if h % n:
        raise TensorParallelError(f"--tensor-parallel {n}: the model's {h} attention heads do not split evenly "
                                  f"over {n} ranks; use a divisor of {h}")
    if kv % n and n % kv:
        raise TensorParallelError(f"--tensor-parallel {n}: the model's {kv} KV heads can neither be split over "
                                  f"nor replicated across {n} ranks; use a divisor or a multiple of {kv} "
                                  f"that divides {h}")
    if f % n:
        raise TensorParallelError(f"--tensor-parallel {n}: intermediate_size {f} does not split evenly over "
                                  f"{n} ranks")


def vocab_shard(cfg: ModelConfig, n: int) -> int:
    """Rows of the embedding (and lm_head) each rank holds, padding included."""
    return cdiv(cfg.vocab_size, n)


def kv_heads_of(cfg: ModelConfig, n: int, rank: int) -> range:
    """The global KV heads `rank` holds."""
    kv = cfg.num_kv_heads
    if kv >= n:
        per = kv // n
        return range(rank * per, (rank + 1) * per)
    head = rank // (n // kv)
    return range(head, head + 1)


def local_config(cfg: ModelConfig, n: int) -> ModelConfig:
    """The model as one rank sees it: its heads, its MLP columns, its vocabulary shard."""
    check(cfg, n)
    return dataclasses.replace(cfg, num_heads=cfg.num_heads // n, num_kv_heads=max(1, cfg.num_kv_heads // n),
                               intermediate_size=cfg.intermediate_size // n, vocab_size=vocab_shard(cfg, n))


def slices(cfg: ModelConfig, n: int, rank: int) -> dict[str, Slice | None]:
    """Every checkpoint tensor name -> the Slice `rank` holds (None: the whole tensor)."""
    check(cfg, n)
    if not 0 <= rank < n:
        raise ValueError(f"rank {rank} is outside [0, {n})")
    d = cfg.head_dim
    q = cfg.num_heads // n * d
    kvs = kv_heads_of(cfg, n, rank)
    f = cfg.intermediate_size // n
    v = vocab_shard(cfg, n)

    def rows(start: int, stop: int, size: int | None = None) -> Slice:
        return Slice(0, start, stop, stop - start if size is None else size)

    plan: dict[str, Slice | None] = {}
    for name in checkpoint_shapes(cfg):
        part = name.rsplit(".", 1)[0]   # e.g. model.layers.3.self_attn.q_proj
        kind = part.rsplit(".", 1)[-1]
        if kind == "q_proj":
            plan[name] = rows(rank * q, (rank + 1) * q)
        elif kind in ("k_proj", "v_proj"):
            plan[name] = rows(kvs.start * d, kvs.stop * d)
        elif kind in ("gate_proj", "up_proj"):
            plan[name] = rows(rank * f, (rank + 1) * f)
        elif kind in ("o_proj", "down_proj") and name.endswith(".weight"):
            width = q if kind == "o_proj" else f
            plan[name] = Slice(1, rank * width, (rank + 1) * width, width)
        elif kind in ("embed_tokens", "lm_head"):
            plan[name] = rows(rank * v, min((rank + 1) * v, cfg.vocab_size), v)
        else:   # norms, and the row-parallel biases (whole; rank 0 alone adds them, load.py)
            plan[name] = None
    return plan


def shard_weights(weights, cfg: ModelConfig, n: int, rank: int):
    """Rank `rank`'s share of fused ModelWeights (weights.fuse's layout) already in memory: its q, k
    and v heads and its gate/up rows (column-parallel), its columns of o_proj and down_proj
    (row-parallel; their biases on rank 0 alone), norms whole, and its vocabulary shard of the
    embedding and lm_head (vocab_shard rows, the last shard padded with zero rows). Shapes:
    local_config's, as load_shard reads them."""
    import torch

    from warploop.llm.weights import LayerWeights, ModelWeights

    check(cfg, n)
    if not 0 <= rank < n:
        raise ValueError(f"rank {rank} is outside [0, {n})")
    d, h = cfg.head_dim, cfg.num_heads
    q, kv, f = h // n * d, kv_heads_of(cfg, n, rank), cfg.intermediate_size // n
    ks, vs = cfg.q_size + kv.start * d, cfg.q_size + cfg.kv_size + kv.start * d
    qkv_rows = [(rank * q, (rank + 1) * q), (ks, ks + len(kv) * d), (vs, vs + len(kv) * d)]
    gu_rows = [(rank * f, (rank + 1) * f), (cfg.intermediate_size + rank * f, cfg.intermediate_size + (rank + 1) * f)]

    def rows(t, spans):
        return None if t is None else torch.cat([t[a:b] for a, b in spans]).contiguous()

    def cols(t, a, b):
        return t[:, a:b].contiguous()

    layers = [LayerWeights(
        input_norm=lw.input_norm, qkv=rows(lw.qkv, qkv_rows), qkv_bias=rows(lw.qkv_bias, qkv_rows),
        o=cols(lw.o, rank * q, (rank + 1) * q), o_bias=lw.o_bias if rank == 0 else None, post_norm=lw.post_norm,
        gate_up=rows(lw.gate_up, gu_rows), gate_up_bias=rows(lw.gate_up_bias, gu_rows),
        down=cols(lw.down, rank * f, (rank + 1) * f), down_bias=lw.down_bias if rank == 0 else None,
        q_norm=lw.q_norm, k_norm=lw.k_norm) for lw in weights.layers]
    v = vocab_shard(cfg, n)

    def vocab(t):
        part = t[rank * v:min((rank + 1) * v, cfg.vocab_size)]
        return (part if part.shape[0] == v else torch.cat([part, part.new_zeros(v - part.shape[0], part.shape[1])])
                ).contiguous()
    embed = vocab(weights.embed)
    lm_head = embed if weights.lm_head is weights.embed else vocab(weights.lm_head)
    return ModelWeights(embed=embed, layers=layers, norm=weights.norm, lm_head=lm_head)
