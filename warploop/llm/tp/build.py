"""A tensor-parallel backend over N ranks: start the workers, load every rank's shard, agree on the
KV pool, build the sharded backends.

Start-up, rank 0 and each worker in step: join the group; read the shard (or build random weights);
report how many KV blocks fit this rank's memory; build the backend with the smallest count of all
ranks, so every rank's pool has the same blocks (the engine's block tables index all of them).
"""
from __future__ import annotations

import dataclasses

from warploop.llm.build import kv_blocks_for
from warploop.llm.config import ModelConfig
from warploop.llm.kv_cache import KVCacheLayout
from warploop.llm.tp import group
from warploop.llm.tp.allreduce import check_mode
from warploop.llm.tp.shard import check, local_config


@dataclasses.dataclass(frozen=True)
class RankJob:
    """What every rank needs to build its part (sent to the workers, so plain data)."""

    cfg: ModelConfig
    model_dir: str | None       # None: random weights (benchmarks)
    dtype: str                  # float32 | bfloat16 | float16
    block_size: int
    num_kv_blocks: int | None   # None: what memory allows, smallest over the ranks
    max_num_seqs: int
    max_len: int
    use_cuda_graphs: bool
    backend: str = "torch"      # torch: per op; stream: decode on the streaming decoder, prefill per op

    def __post_init__(self) -> None:
        if self.backend not in ("torch", "stream"):
            raise ValueError(f"--backend {self.backend} does not run under --tensor-parallel: use torch or stream")
        for name in ("block_size", "max_num_seqs", "max_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be positive, got {self.num_kv_blocks}")


class _Rank:
    """One rank's state while it starts: its weights, then its backend."""

    def __init__(self, spec: group.GroupSpec, rank: int, job: RankJob) -> None:
        import torch

        from warploop.llm.tp.load import load_shard, random_shard, stream_shard

        self.spec, self.rank, self.job = spec, rank, job
        self.device = group.rank_device(spec, rank)
        dtype = getattr(torch, job.dtype)
        self.stream_weights = None        # the streaming decoder's: the per-op backend's own
        if job.backend == "stream":
            self.weights = self.stream_weights = stream_shard(job.model_dir, job.cfg, spec.world, rank, self.device,
                                                              dtype)
        elif job.model_dir is None:
            self.weights = random_shard(job.cfg, spec.world, rank, self.device, dtype)
        else:
            self.weights = load_shard(job.model_dir, job.cfg, spec.world, rank, self.device, dtype)
        self.local = local_config(job.cfg, spec.world)
        self.backend = self.decoder = None

    def layout(self, blocks: int) -> KVCacheLayout:
        c = self.local
        return KVCacheLayout(c.num_layers, blocks, self.job.block_size, c.num_kv_heads, c.head_dim, self.job.dtype)

    def blocks_that_fit(self) -> int:
        job = self.job
        return job.num_kv_blocks or kv_blocks_for(self.layout(1), self.device, job.max_num_seqs, job.max_len)

    def build(self, blocks: int):
        from warploop.llm.tp.backend import ShardedBackend

        max_context = min(self.job.max_len, blocks * self.job.block_size)
        packed = None
        if self.stream_weights is not None:   # the layers become views of the pools, shared by both paths
            from warploop.llm.stream_pools import pack_pools
            packed = pack_pools(self.stream_weights, self.device, share=True)
        self.backend = ShardedBackend(self.job.cfg, self.spec.world, self.rank, self.weights, self.layout(blocks),
                                      self.device, max_context, use_cuda_graphs=self.job.use_cuda_graphs)
        if packed is not None:
            from warploop import config
            from warploop.llm.stream_step import StreamDecoder
            from warploop.llm.stream_tp import GroupRank
            self.decoder = StreamDecoder(self.job.cfg, self.stream_weights, device=self.device,
                                         max_context=max_context, block_size=self.job.block_size,
                                         kv=self.backend.kv, pools=packed, prebuilt=config.get().stream_prebuilt,
                                         tp=GroupRank())
        return self.backend, max_context


def worker_main(spec: group.GroupSpec, rank: int, conn, job: RankJob) -> None:
    """Entry point of ranks 1..N-1 (a spawned process)."""
    conn.send(("ok", "started"))
    try:
        group.init_rank(spec, rank)
        state = _Rank(spec, rank, job)
        conn.send(("ok", state.blocks_that_fit()))
    except Exception as e:
        conn.send(("error", f"{type(e).__name__}: {e}"))
        raise

    def handle(kind: str, value):
        from warploop.llm.tp.backend import receive_batch

        if kind == "forward":
            state.backend.forward(receive_batch(value, state.device))
            return None
        if kind == "build":
            state.build(value)
            return "built"
        if kind == "warmup":
            state.backend.warmup(value)
            return "warm"
        if kind == "stream":              # rank 0's decoder launched this: the same launch here
            method, args, kwargs = value
            getattr(state.decoder, method)(*args, **kwargs)
            return None
        raise ValueError(f"unknown message {kind!r}")

    try:
        group.worker_loop(conn, handle)
    finally:
        if state.backend is not None:
            state.backend.close()     # its CUDA graphs, before the NCCL communicator they hold
        group.leave()


def build_tp_backend(cfg: ModelConfig, world: int, device, job: RankJob):
    """(TensorParallelBackend, max_context) over `world` ranks; rank 0 is this process, on `device`.
    With job.backend "stream", a StreamBackend over it: decode on every rank's streaming decoder
    (BroadcastDecoder has the other ranks run each of rank 0's launches), prefill per op."""
    import torch

    from warploop.llm.tp.backend import BroadcastDecoder, TensorParallelBackend

    check(cfg, world)
    if job.backend == "stream":           # refused here, before any rank starts
        from warploop.llm.stream_step import unsupported
        why = unsupported(cfg, job.dtype)
        if why:
            raise ValueError(f"the streaming backend cannot run this model: {why}; use --backend torch")
    if device.type == "cuda" and torch.cuda.device_count() < world:
        raise ValueError(f"--tensor-parallel {world} needs {world} GPUs but {torch.cuda.device_count()} are visible; "
                         "lower it or set CUDA_VISIBLE_DEVICES")
    if device.type == "cuda" and (device.index or 0) != 0:
        raise ValueError(f"--tensor-parallel uses GPUs 0..{world - 1}; choose them with CUDA_VISIBLE_DEVICES "
                         f"rather than device {device}")
    check_mode(device, getattr(torch, job.dtype))     # a bad WARPLOOP_TP_ALLREDUCE fails before any rank starts
    ranks = group.Ranks(world, device.type, worker_main, job)
    try:
        state = _Rank(ranks.spec, 0, job)
        blocks = min([state.blocks_that_fit(), *ranks.replies()])
        ranks.send(("build", blocks))
        backend, max_context = state.build(blocks)
        ranks.replies()
        made = TensorParallelBackend(cfg, backend, ranks)
        if job.backend == "stream":
            from warploop.llm.stream_backend import StreamBackend
            made = StreamBackend(cfg, None, backend.layout, device, max_context, per_op=made,
                                 decoder=BroadcastDecoder(state.decoder, ranks))
        return made, max_context
    except BaseException:
        ranks.close()
        raise
