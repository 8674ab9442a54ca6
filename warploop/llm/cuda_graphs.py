"""CUDA graphs for the decode step: one graph per batch-size bucket, replayed with new inputs.

A decode step is ~10 kernels per layer; launched one by one from Python that costs more than the
kernels themselves at batch 1. Each graph reads its inputs from one device buffer, filled from a
pinned host buffer with a single copy per step:

    [token ids (N) | positions (N) | slots (N) | context lens (N) | block tables (N x W)]   int32

N = the largest bucket, W = blocks per sequence at the longest context. A batch of n sequences
replays the smallest bucket >= n; rows past n have context length 0 and slot -1, so they read
nothing and write nothing.
"""
from __future__ import annotations

import torch

from warploop.llm.backend import ModelBatch


def buckets(max_batch: int) -> list[int]:
    small = [b for b in (1, 2, 4, 8) if b < max_batch]
    return small + list(range(16, max_batch, 16)) + [max_batch]


class DecodeGraphs:
    def __init__(self, backend, max_batch: int) -> None:
        self.max_batch = max_batch
        self.buckets = buckets(max_batch)
        n, w = max_batch, backend.max_blocks_per_seq
        self.width, self.block_size = w, backend.layout.block_size
        # two host buffers, used in turn: the engine launches step n + 1 before step n's copy has
        # necessarily run, so a buffer is refilled only after the copy that read it has finished
        self.hosts = [torch.zeros(4 * n + n * w, dtype=torch.int32).pin_memory() for _ in range(2)]
        for host in self.hosts:
            host.numpy()[2 * n:3 * n] = -1
        self.copied = [torch.cuda.Event(), torch.cuda.Event()]
        self.turn = 0
        self.dev = self.hosts[0].to(backend.device)
        ids, pos, slots, ctx = (self.dev[i * n:(i + 1) * n] for i in range(4))
        tables = self.dev[4 * n:].view(n, w)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        pool = torch.cuda.graph_pool_handle()
        for b in reversed(self.buckets):  # largest first, so the smaller ones fit in its memory
            args = (ids[:b], pos[:b], slots[:b], ctx[:b], tables[:b])
            backend.decode(*args)  # compiles the Triton kernels, initialises cuBLAS
            torch.cuda.synchronize(backend.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[b] = backend.decode(*args)
            self.graphs[b] = graph
        torch.cuda.synchronize(backend.device)

    def release(self) -> None:
        """Destroy the captured graphs now. A graph that captured an NCCL collective holds a reference
        on its communicator, and NCCL's communicator destroy waits for every such graph to be gone
        (pytorch issue 115388): tensor parallelism releases its graphs before it leaves the group."""
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.outputs.clear()

    def run(self, batch: ModelBatch) -> torch.Tensor:
        count = batch.num_seqs
        bucket = next(b for b in self.buckets if b >= count)
        host, copied = self.hosts[self.turn], self.copied[self.turn]
        self.turn ^= 1
        copied.synchronize()  # the copy that last read this buffer (a no-op for a fresh event)
        n, w, h, bs = self.max_batch, self.width, host.numpy(), self.block_size
        on_device = isinstance(batch.token_ids, torch.Tensor)  # ids sampled by the step before
        if not on_device:
            h[0:count] = batch.token_ids
        h[n:n + count] = batch.positions
        h[2 * n:2 * n + count] = [t[p // bs] * bs + p % bs
                                  for t, p in zip(batch.block_tables, batch.positions, strict=True)]
        h[2 * n + count:2 * n + bucket] = -1
        h[3 * n:3 * n + count] = batch.context_lens
        h[3 * n + count:3 * n + bucket] = 0
        for i, table in enumerate(batch.block_tables):
            h[4 * n + i * w:4 * n + i * w + len(table)] = table
        used = 4 * n + bucket * w
        self.dev[:used].copy_(host[:used], non_blocking=True)
        copied.record()
        if on_device:
            self.dev[:count].copy_(batch.token_ids)
        self.graphs[bucket].replay()
        return self.outputs[bucket][:count]
