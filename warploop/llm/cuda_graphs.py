"""CUDA graphs, replayed with new inputs: the decode step, one graph per batch-size bucket, and
prefill (PrefillGraphs, below), one per token bucket.

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


class Staging:
    """A graph's int32 inputs: one device buffer, filled from two host buffers (pinned on a GPU) used
    in turn. The engine launches step n + 1 before step n's copy has necessarily run, so a host
    buffer is handed out again only after the copy that last read it has finished."""

    def __init__(self, size: int, device: torch.device) -> None:
        cuda = device.type == "cuda"
        self.hosts = [torch.zeros(size, dtype=torch.int32) for _ in range(2)]
        if cuda:
            self.hosts = [h.pin_memory() for h in self.hosts]
        self.copied = [torch.cuda.Event(), torch.cuda.Event()] if cuda else None
        self.turn = 0
        self.dev = self.hosts[0].to(device, copy=True)

    def host(self):
        """The host buffer to fill next (numpy), once the copy that last read it is done."""
        if self.copied is not None:
            self.copied[self.turn].synchronize()  # a no-op for a fresh event
        return self.hosts[self.turn].numpy()

    def send(self, used: int) -> None:
        """Copy the first `used` values of the buffer host() gave to the device buffer."""
        self.dev[:used].copy_(self.hosts[self.turn][:used], non_blocking=True)
        if self.copied is not None:
            self.copied[self.turn].record()
        self.turn ^= 1


class DecodeGraphs:
    def __init__(self, backend, max_batch: int) -> None:
        self.max_batch = max_batch
        self.buckets = buckets(max_batch)
        n, w = max_batch, backend.max_blocks_per_seq
        self.width, self.block_size = w, backend.layout.block_size
        self.staging = Staging(4 * n + n * w, backend.device)
        for host in self.staging.hosts:
            host.numpy()[2 * n:3 * n] = -1
        self.dev = self.staging.dev
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
        n, w, h, bs = self.max_batch, self.width, self.staging.host(), self.block_size
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
        self.staging.send(4 * n + bucket * w)
        if on_device:
            self.dev[:count].copy_(batch.token_ids)
        self.graphs[bucket].replay()
        return self.outputs[bucket][:count]


PREFILL_BUCKETS = (64, 128, 256, 512, 1024, 2048, 4096, 8192)
PREFILL_SEQS = 4            # sequences a prefill graph takes; a batch of more runs eagerly


class PrefillGraphs:
    """CUDA graphs for prefill batches of up to PREFILL_SEQS sequences and `max_tokens` tokens,
    attending from the pages (paged_attention.prefill_attention), one graph per token bucket,
    captured the first time a batch needs it. A small model's prefill is bound by its launches
    (SmolLM2-135M: 30 layers, about 270 launches a prompt), which a replay makes one.

    The inputs live in one device buffer, filled from a pinned host buffer by one copy:

        [token ids (T) | positions (T) | slots (T) | logits rows (S) | PrefillPlan (plan_ints)]   int32

    T = max_tokens, S = PREFILL_SEQS + 1 (a spare sequence for the query blocks a batch leaves
    unused). Tokens past the batch's have slot -1 (they write no KV) and belong to no query block;
    their rows hold garbage that no real row reads (every op but attention is row by row). Off a GPU
    (the tests, through Triton's interpreter) the same buffers run eagerly, with no graph."""

    def __init__(self, backend, max_tokens: int) -> None:
        from warploop.llm.paged_attention import PREFILL_BM, cdiv, plan_size
        self.backend, self.max_tokens = backend, max_tokens
        self.buckets = [b for b in PREFILL_BUCKETS if b < max_tokens] + [max_tokens]
        self.seqs, self.width = PREFILL_SEQS + 1, backend.max_blocks_per_seq
        self.blocks = {b: cdiv(b, PREFILL_BM) + PREFILL_SEQS - 1 for b in self.buckets}
        t = max_tokens
        self.plan_at = 3 * t + self.seqs
        size = self.plan_at + plan_size(self.blocks[t], self.seqs, self.width)
        self.cuda = backend.device.type == "cuda"
        self.staging = Staging(size, backend.device)
        self.dev = self.staging.dev
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = torch.cuda.graph_pool_handle() if self.cuda else None
        self.runs = 0               # batches run through the buffers (replays, on a GPU)

    def fits(self, batch: ModelBatch) -> bool:
        return (not batch.is_decode and batch.logits_indices is None and batch.num_seqs <= PREFILL_SEQS
                and len(batch.token_ids) <= self.max_tokens and not isinstance(batch.token_ids, torch.Tensor))

    def run(self, batch: ModelBatch) -> torch.Tensor:
        from warploop.llm.paged_attention import plan_ints
        n, t, count = len(batch.token_ids), self.max_tokens, batch.num_seqs
        bucket = next(b for b in self.buckets if b >= n)
        h = self.staging.host()
        h[0:n], h[n:bucket] = batch.token_ids, 0
        h[t:t + n], h[t + n:t + bucket] = batch.positions, 0
        h[2 * t:2 * t + n], h[2 * t + n:2 * t + bucket] = batch.slot_mapping(self.backend.layout.block_size), -1
        h[3 * t:3 * t + count], h[3 * t + count:3 * t + self.seqs - 1] = batch.rows_for_logits(), 0
        plan = plan_ints(batch.block_tables, batch.query_lens, batch.context_lens, self.blocks[bucket], self.seqs,
                         self.width)
        h[self.plan_at:self.plan_at + len(plan)] = plan
        self.staging.send(self.plan_at + len(plan))
        self.runs += 1
        if not self.cuda:
            return self.backend.paged_forward(*self._inputs(bucket))[:count]
        if bucket not in self.graphs:
            self._capture(bucket)
        self.graphs[bucket].replay()
        return self.outputs[bucket][:count]

    def _inputs(self, bucket: int):
        from warploop.llm.paged_attention import PrefillPlan
        t, d = self.max_tokens, self.dev
        plan = PrefillPlan.over(d[self.plan_at:], self.blocks[bucket], self.seqs, self.width, bucket)
        return d[:bucket], d[t:t + bucket], d[2 * t:2 * t + bucket], d[3 * t:3 * t + self.seqs - 1], plan

    def _capture(self, bucket: int) -> None:
        """Run the bucket once eagerly (cuBLAS picks its kernels for these shapes), then capture it
        over the inputs just copied; capture errors stay this thread's (the engine's other threads
        touch CUDA too)."""
        args = self._inputs(bucket)
        self.backend.paged_forward(*args)
        torch.cuda.synchronize(self.backend.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            self.outputs[bucket] = self.backend.paged_forward(*args)
        self.graphs[bucket] = graph

    def release(self) -> None:
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.outputs.clear()
