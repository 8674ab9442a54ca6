"""The sharded forward, and the step protocol between rank 0 and the other ranks.

Every rank runs `ShardedBackend`: the per-op TorchBackend over its local config (its heads, MLP
columns and vocabulary shard) plus three collectives per layer stack: the embedding rows are summed
across ranks (each rank looks up only the ids in its shard), o_proj and down_proj outputs are summed
(row-parallel; allreduce.py: NCCL or a symmetric-memory one-shot kernel), and the lm_head shards are
all-gathered into full logits.

Rank 0's engine sees `TensorParallelBackend`. Per step it sends the batch (host lists) to the other
ranks over their pipes; when the step's token ids were sampled on the device by the step before,
it broadcasts them over the group instead. Every rank then runs the same ops in the same order, so
their collectives pair up, CUDA-graph replays included (each rank captures the same buckets).
"""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F

from warploop.llm.backend import Backend, ModelBatch
from warploop.llm.backend_torch import TorchBackend
from warploop.llm.config import ModelConfig
from warploop.llm.kv_cache import KVCacheLayout
from warploop.llm.tp.allreduce import AllReduce
from warploop.llm.tp.group import Ranks
from warploop.llm.tp.shard import local_config, vocab_shard

# torch 2.13 renamed all_gather_into_tensor (and deprecates the old name); the GPU machines run 2.11
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class ShardedBackend(TorchBackend):
    """One rank's part of the model; `layout` is the rank's KV cache (its own KV heads)."""

    def __init__(self, cfg: ModelConfig, world: int, rank: int, weights, layout: KVCacheLayout, device,
                 max_context: int, use_cuda_graphs: bool = True) -> None:
        super().__init__(local_config(cfg, world), weights, layout, device, max_context,
                         use_cuda_graphs=use_cuda_graphs)
        self.world, self.vocab_size = world, cfg.vocab_size
        self.vocab_start = rank * vocab_shard(cfg, world)
        self.reduce = AllReduce(self.device, self.w.embed.dtype, cfg.hidden_size)

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids.long() - self.vocab_start
        inside = (local >= 0) & (local < self.w.embed.shape[0])
        x = F.embedding(local.clamp(0, self.w.embed.shape[0] - 1), self.w.embed) * inside[:, None].to(
            self.w.embed.dtype)
        return self._all_reduce(x)

    def _all_reduce(self, partial: torch.Tensor) -> torch.Tensor:
        return self.reduce(partial)

    def _lm_head(self, h: torch.Tensor) -> torch.Tensor:
        local = F.linear(h, self.w.lm_head)
        rows, width = local.shape
        shards = local.new_empty((self.world * rows, width))   # rank-major, as gloo and NCCL both take it
        _all_gather(shards, local.contiguous())
        return shards.view(self.world, rows, width).permute(1, 0, 2).reshape(rows, -1)[:, :self.vocab_size].float()


def batch_message(batch: ModelBatch) -> tuple[ModelBatch, int | None]:
    """What rank 0 sends the other ranks for `batch`: the batch with host-side ids, or the batch
    without ids and their count when the ids are a device tensor (they follow by broadcast)."""
    if isinstance(batch.token_ids, torch.Tensor):
        return dataclasses.replace(batch, token_ids=[]), int(batch.token_ids.shape[0])
    return batch, None


def receive_batch(message: tuple[ModelBatch, int | None], device) -> ModelBatch:
    """A worker's side of batch_message (joins the broadcast of device-side ids)."""
    batch, count = message
    if count is None:
        return batch
    ids = torch.empty(count, dtype=torch.int64, device=device)
    dist.broadcast(ids, 0)
    return dataclasses.replace(batch, token_ids=ids)


class BroadcastDecoder:
    """Rank 0's streaming decoder under tensor parallelism (stream_step.StreamDecoder with tp): each
    launch, and each gathering of the logits, is sent to the other ranks first, whose decoders do the
    same, so the ranks' all-reduce nodes and gathers pair up (over symmetric memory and NCCL on GPUs,
    gloo on the CPU); everything else is rank 0's decoder's own (its tokens are every rank's)."""

    LAUNCHES = ("step", "step_rows", "launch", "launch_rows", "generate", "generate_rows", "logits")

    def __init__(self, decoder, ranks: Ranks) -> None:
        self._decoder, self._ranks = decoder, ranks

    def __getattr__(self, name: str):
        attr = getattr(self._decoder, name)
        if name not in self.LAUNCHES:
            return attr

        def launch(*args, **kwargs):
            self._ranks.check_alive()
            self._ranks.send(("stream", (name, args, kwargs)))
            return attr(*args, **kwargs)
        return launch


class TensorParallelBackend(Backend):
    """Rank 0: runs its shard, and has the other ranks run theirs on the same batch."""

    def __init__(self, cfg: ModelConfig, shard: ShardedBackend, ranks: Ranks) -> None:
        super().__init__(cfg, shard.layout, shard.device)
        self.shard, self.ranks = shard, ranks

    @property
    def max_blocks_per_seq(self) -> int:
        return self.shard.max_blocks_per_seq

    def warmup(self, max_num_seqs: int) -> None:
        self.ranks.send(("warmup", max_num_seqs))
        self.shard.warmup(max_num_seqs)
        self.ranks.replies()

    def forward(self, batch: ModelBatch) -> torch.Tensor:
        self.ranks.check_alive()   # a dead peer fails the step at once instead of at the collective timeout
        message = batch_message(batch)
        self.ranks.send(("forward", message))
        if message[1] is not None:   # on this rank's device: NCCL moves no host tensors
            ids = batch.token_ids.to(self.device, torch.int64).contiguous()
            dist.broadcast(ids, 0)
            batch = dataclasses.replace(batch, token_ids=ids)
        return self.shard.forward(batch)

    def close(self) -> None:
        self.shard.close()     # its CUDA graphs first: they hold the NCCL communicator
        self.ranks.close()
