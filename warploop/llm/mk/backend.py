"""MegakernelBackend: decode steps as one static graph on the resident runtime; prefill per op.

Under the Backend contract (backend.py): `forward` of a decode batch (one token per sequence,
logits for each) fills the graph's step inputs and replays the graph of the smallest batch
bucket that holds it; the graph writes the new tokens' KV into the same paged cache the per-op
path uses, so prefill (and any batch the graph does not take) runs on the per-op TorchBackend
over that cache. On the CPU the graph runs on the runtime's CPU executor, through the Triton
interpreter: the reference the GPU is checked against.
"""
from __future__ import annotations

import torch

from warploop.llm.backend import Backend, ModelBatch
from warploop.llm.backend_torch import TorchBackend
from warploop.llm.config import ModelConfig
from warploop.llm.cuda_graphs import buckets
from warploop.llm.kv_cache import KVCacheLayout
from warploop.llm.mk.graph import DecodeGraph, StepBuffers, build_decode_graph
from warploop.llm.mk.layout import F_ROWS, TRITON_DTYPES, Plan, StepInputs
from warploop.llm.mk.tasks import tasks_for
from warploop.llm.weights import ModelWeights

CPU_PLAN = {"splits": 2, "bn": 128, "bk": 256}       # fewer, larger tiles: the interpreter pays per op
GPU_PLAN = {"splits": 4, "bn": 16, "bk": 256}


def plan_for(config: ModelConfig, dtype, block_size: int, device_type: str, **overrides) -> Plan:
    name = TRITON_DTYPES.get(str(dtype).removeprefix("torch."))
    if name is None:
        raise ValueError(f"the megakernel backend runs float32, bfloat16 or float16 weights, not {dtype}")
    sizes = {**(CPU_PLAN if device_type == "cpu" else GPU_PLAN), **overrides}
    return Plan(name, config.num_heads, config.num_kv_heads, config.head_dim, block_size, **sizes)


class MegakernelBackend(Backend):
    def __init__(self, config: ModelConfig, weights: ModelWeights, layout: KVCacheLayout, device, max_context: int,
                 workers: int | None = None, timeout: float = 60.0, **plan_overrides) -> None:
        super().__init__(config, layout, torch.device(device))
        self.per_op = TorchBackend(config, weights, layout, device, max_context, use_cuda_graphs=False)
        self.w, self.kv, self.max_context = weights, self.per_op.kv, max_context
        self.cos, self.sin = self.per_op.cos.contiguous(), self.per_op.sin.contiguous()
        self.plan = plan_for(config, weights.embed.dtype, layout.block_size, self.device.type, **plan_overrides)
        self.tasks = tasks_for(self.plan)
        self.width = -(max_context // -layout.block_size)
        self.workers, self.timeout = workers, timeout
        self.rt = None
        self.last: DecodeGraph | None = None      # the graph of the latest decode step
        self.buckets: list[int] = []
        self.graphs: dict[int, DecodeGraph] = {}
        self.host_inputs = None     # pinned staging for the GPU copy of the step inputs
        self.copy_stream = None

    def warmup(self, max_num_seqs: int) -> None:
        """Allocate every bucket's buffers, then start the resident kernel and record the graphs.
        Each graph is compiled (placed, uploaded) on its first run."""
        self.per_op.warmup(max_num_seqs)
        self.buckets = buckets(max_num_seqs)
        dtype = self.w.embed.dtype
        buffers = {b: StepBuffers.allocate(self.config, self.plan, b, self.width, dtype, self.device)
                   for b in self.buckets}
        if self.device.type == "cuda":
            self.host_inputs = torch.zeros(StepInputs.words(max(self.buckets), self.width),
                                           dtype=torch.int32).pin_memory()
            self.copy_stream = torch.cuda.Stream(self.device)
        from warploop.runtime import Runtime
        self.rt = Runtime(device="cpu" if self.device.type == "cpu" else None, workers=self.workers,
                          tasks=self.tasks.all, timeout=self.timeout)
        nodes = self.rt.workers
        for b in self.buckets:
            self.graphs[b] = build_decode_graph(self.rt, self.tasks, self.plan, self.config, self.w, self.kv, self.cos,
                                                self.sin, buffers[b], b, self.width, nodes)

    def forward(self, batch: ModelBatch) -> torch.Tensor:
        if self.rt is None or not batch.is_decode or batch.logits_indices is not None \
                or batch.num_seqs > self.buckets[-1]:
            return self.per_op.forward(batch)
        return self.decode(batch)

    def decode(self, batch: ModelBatch) -> torch.Tensor:
        """One decode step on the graph; float32 logits [num_seqs, vocab]."""
        n = batch.num_seqs
        dg = self.graphs[next(b for b in self.buckets if b >= n)]
        if self.device.type == "cuda":
            # the sampler of the step before read this graph's logits on the default stream, and
            # device-side token ids come from it: let it finish (the resident kernel is not on it)
            torch.cuda.current_stream(self.device).synchronize()
        ids = batch.token_ids.tolist() if isinstance(batch.token_ids, torch.Tensor) else list(batch.token_ids)
        slots = batch.slot_mapping(self.layout.block_size).tolist()
        words = StepInputs(dg.batch, dg.width, tuple(ids), tuple(batch.positions), tuple(batch.context_lens),
                           tuple(slots), tuple(tuple(t) for t in batch.block_tables)).serialize()
        inp = dg.buffers.inp
        if self.copy_stream is None:
            inp.numpy()[:] = words
        else:
            # a copy, not a kernel: it runs beside the resident kernel on a stream of its own
            self.host_inputs.numpy()[:len(words)] = words
            with torch.cuda.stream(self.copy_stream):
                inp.copy_(self.host_inputs[:len(words)], non_blocking=True)
            self.copy_stream.synchronize()
        dg.graph.run(inp=inp, timeout=self.timeout)
        self.last = dg
        return dg.buffers.logits[:n].clone()

    def last_greedy_tokens(self) -> list[int]:
        """The graph's own argmax for each sequence of the latest decode step."""
        if self.last is None:
            raise RuntimeError("no decode step has run on the megakernel yet")
        return self.last.buffers.tokens[:int(self.last.buffers.inp[F_ROWS])].tolist()

    def close(self) -> None:
        if self.rt is not None:
            self.rt.close()
            self.rt = None
