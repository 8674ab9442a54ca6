"""The streaming decoder under tensor parallelism: a rank's side of the ranks' group, and the model as
one rank's program sees it. docs/parallel.md."""
from __future__ import annotations

from warploop.llm.config import ModelConfig
from warploop.llm.weights import ModelWeights


class GroupRank:
    """A tensor-parallel rank in a process of its own (StreamDecoder's tp): the ranks'
    torch.distributed group. On a GPU (NCCL) the executors set up their arenas and counters in
    symmetric memory over it; on the CPU (gloo) the reference's all-reduce nodes gather the ranks'
    partials through it; on both, the logits' vocabulary shards are gathered through it."""

    def __init__(self, group=None) -> None:
        import torch.distributed as dist
        self.group = group or dist.group.WORLD
        self.rank, self.world = dist.get_rank(self.group), dist.get_world_size(self.group)

    def gather(self, tensor) -> list:
        """Every rank's `tensor`, in rank order (a collective: every rank calls it)."""
        import torch.distributed as dist
        parts = [tensor.new_empty(tensor.shape) for _ in range(self.world)]
        dist.all_gather(parts, tensor.contiguous(), group=self.group)
        return parts


def rank_config(cfg: ModelConfig, world: int, weights: ModelWeights) -> ModelConfig:
    """The model as one tensor-parallel rank's streaming program sees it (tp.shard.local_config's
    heads and MLP columns, the whole vocabulary), its share of the weights checked against it."""
    import dataclasses

    from warploop.llm.tp.shard import local_config, vocab_shard
    local = dataclasses.replace(local_config(cfg, world), vocab_size=cfg.vocab_size)
    lw = weights.layers[0]
    want = {"qkv": (local.q_size + 2 * local.kv_size, cfg.hidden_size), "o": (cfg.hidden_size, local.q_size),
            "gate_up": (2 * local.intermediate_size, cfg.hidden_size),
            "down": (cfg.hidden_size, local.intermediate_size)}
    for name, shape in want.items():
        if tuple(getattr(lw, name).shape) != shape:
            raise ValueError(f"a rank of {world} holds {name} of {shape}, not {tuple(getattr(lw, name).shape)}: "
                             "pass the rank's share (tp.shard.shard_weights)")
    v = vocab_shard(cfg, world)
    if weights.embed.shape[0] != v or weights.lm_head.shape[0] != v:
        raise ValueError(f"a rank of {world} holds {v} rows of the embedding and of lm_head (its vocabulary shard, "
                         f"tp.shard.shard_weights), not {weights.embed.shape[0]} and {weights.lm_head.shape[0]}")
    return local
