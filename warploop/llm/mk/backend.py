"""MegakernelBackend: decode steps as one static graph on the resident runtime; prefill per op.

Under the Backend contract (backend.py): `forward` of a decode batch (one token per sequence,
logits for each) fills the graph's step inputs and replays the graph of the smallest batch
bucket that holds it; the graph writes the new tokens' KV into the same paged cache the per-op
path uses, so prefill (and any batch the graph does not take) runs on the per-op TorchBackend
over that cache. On the CPU the graph runs on the runtime's CPU executor, through the Triton
interpreter: the reference the GPU is checked against.

`forward_sample` hands the engine token ids the graph sampled itself (warploop/llm/mk/sample.py),
each row with its own parameters in the step inputs; a row the graph cannot draw exactly (its
filters reach past the candidates) is sampled on the host path from the same logits.

On a GPU two resident kernels serve the graphs (`batch1_kernel`): one compiled for the batch-1
graph alone (Plan.one_row: its GEMV tiles carry no batch path, so fewer registers and no shared
memory for tl.dot blocks) and one for the graphs of more rows.
One kernel holds every SM slot, so the backend parks the other before it runs a graph.
"""
from __future__ import annotations

import dataclasses
import sys
import threading

import numpy as np
import torch

from warploop.llm.backend import Backend, ModelBatch, first_token_rows
from warploop.llm.backend_torch import TorchBackend
from warploop.llm.config import ModelConfig
from warploop.llm.cuda_graphs import buckets
from warploop.llm.kv_cache import KVCacheLayout
from warploop.llm.mk.graph import DecodeGraph, StepBuffers, build_decode_graph, loop_block
from warploop.llm.mk.layout import F_ROWS, RowSampling, StepInputs
from warploop.llm.mk.loop import MAX_STEPS, LoopRun, Mailbox
from warploop.llm.mk.plans import MegakernelOptions, kernel_plans
from warploop.llm.mk.tasks import tasks_for
from warploop.llm.sampler import SampleRow, sample_on_device
from warploop.llm.weights import ModelWeights

COMPILE_NOTICE_S = 5.0
COMPILE_NOTICE = ("warploop: compiling the decode megakernel for this model shape (the first start of a shape "
                  "takes a few minutes on a GPU; later starts read Triton's cache) ...")


def _aligned(t):
    return t if t is None or t.data_ptr() % 16 == 0 else t.clone()


def aligned_norms(weights: ModelWeights) -> ModelWeights:
    """The weights with every RMSNorm vector 16-byte aligned (a copy where one is not: a view into a
    file's buffer may start anywhere), so the tiles read them 16 bytes at a time (tasks.py: `:16`)."""
    layers = [dataclasses.replace(lw, input_norm=_aligned(lw.input_norm), post_norm=_aligned(lw.post_norm))
              for lw in weights.layers]
    return dataclasses.replace(weights, layers=layers, norm=_aligned(weights.norm))


class MegakernelBackend(Backend):
    name = "megakernel"

    def __init__(self, config: ModelConfig, weights: ModelWeights, layout: KVCacheLayout, device, max_context: int,
                 options: MegakernelOptions | None = None, **keywords) -> None:
        """`options`, or the same as keywords (MegakernelOptions' fields and Plan overrides; keywords
        given with `options` replace its)."""
        super().__init__(config, layout, torch.device(device))
        if options is None or keywords:
            options = MegakernelOptions.of({**(options.keywords() if options else {}), **keywords})
        dtype, bs, where = weights.embed.dtype, layout.block_size, self.device.type
        self.options = options.resolved(where)
        # plan: the batch-1 graph's kernel; plan_many: the other graphs' (the same one without batch1_kernel)
        self.plan, self.plan_many, self.batch1_kernel = kernel_plans(config, dtype, bs, where, self.options)
        self.graph_rows, self.use_cuda_graphs = self.options.graph_rows, self.options.use_cuda_graphs
        # the per-op path: prefill, and decode batches past graph_rows (CUDA graphs for those: warmup)
        self.per_op = TorchBackend(config, weights, layout, device, max_context, use_cuda_graphs=False)
        self.w, self.kv, self.max_context = aligned_norms(weights), self.per_op.kv, max_context
        self.cos, self.sin = self.per_op.cos.contiguous(), self.per_op.sin.contiguous()
        self.tasks = tasks_for(self.plan)
        self.tasks_many = tasks_for(self.plan_many)
        self.width = -(max_context // -layout.block_size)
        # with one split every graph is the fused one; else buckets get a fused graph too when asked
        self.fused_upto = self.options.fused_upto if self.plan.splits > 1 else 0
        self.rt = None              # the runtime of the batch-1 graph
        self.rt_many = None         # ... of the others: self.rt unless batch 1 has a kernel of its own
        self.last: DecodeGraph | None = None      # the graph of the latest decode step
        self.buckets: list[int] = []
        self.graphs: dict[int, DecodeGraph] = {}
        self.fused: dict[int, DecodeGraph] = {}     # per bucket, for contexts up to fused_upto
        self.host_inputs = None     # pinned staging for the GPU copy of the step inputs
        self.host_loop = None       # ... and of the loop block
        self.copy_stream = None
        self.seeds = np.random.default_rng()    # a fresh seed per step for rows that ask for none

    def _runtime(self, tasks):
        from warploop.runtime import Runtime
        # the runtime runs where the weights are, whatever WARPLOOP_DEVICE says (torch calls a ROCm GPU
        # "cuda" too)
        where = "cpu" if self.device.type == "cpu" else ("hip" if torch.version.hip else "cuda")
        o = self.options    # workers "fill" on a GPU: tiles want every SM slot; prefill parks the kernel first
        return Runtime(device=where, workers=o.workers, tasks=tasks.all, timeout=o.timeout, trace=o.trace,
                       worker_warps=o.worker_warps, park_after_us=o.park_after_us, max_registers=o.max_registers)

    @property
    def runtimes(self) -> list:
        """The resident kernels this backend started (one, or the batch-1 kernel and the batches')."""
        return [rt for rt in dict.fromkeys((self.rt, self.rt_many)) if rt is not None]

    def warmup(self, max_num_seqs: int) -> None:
        """Allocate every bucket's buffers, then start the resident kernel(s) and record the graphs.
        The batch-1 graph is compiled (placed, uploaded) here; the others on their first run."""
        rows = min(max_num_seqs, self.graph_rows or max_num_seqs)
        if rows < max_num_seqs and self.device.type == "cuda" and self.per_op.use_triton and self.use_cuda_graphs:
            self.per_op.use_cuda_graphs = True      # the batches the graph leaves to the per-op path
        self.per_op.warmup(max_num_seqs)     # on a GPU: a throwaway prefill (TorchBackend.warm_prefill)
        if self.use_cuda_graphs:
            self.per_op.graph_prefills()     # prefills replay CUDA graphs (captured while the kernel is parked)
        self.buckets = buckets(rows)
        # a start that compiles (the first of a model shape: minutes on a GPU) says so instead of
        # looking hung; one served from Triton's cache returns before the notice is due
        notice = threading.Timer(COMPILE_NOTICE_S, lambda: print(COMPILE_NOTICE, file=sys.stderr, flush=True))
        notice.daemon = True
        notice.start()
        try:
            self.rt = self._runtime(self.tasks)
            if self.batch1_kernel and self.buckets[-1] > 1:
                # each kernel may hold every SM slot: the first parks before the second starts
                self.rt.park()
                self.rt_many = self._runtime(self.tasks_many)
            elif not self.batch1_kernel:
                self.rt_many = self.rt
        finally:
            notice.cancel()
        dtype = self.w.embed.dtype
        if self.device.type == "cuda":
            self.host_inputs = torch.zeros(StepInputs.words(max(self.buckets), self.width,
                                                            self.width * self.plan.block_size),
                                           dtype=torch.int32).pin_memory()
            self.copy_stream = torch.cuda.Stream(self.device)
            self.host_tokens = torch.zeros(max(self.buckets), dtype=torch.int32).pin_memory()
            self.host_loop = torch.zeros(loop_block(max(self.buckets), self.plan.block_size).words,
                                         dtype=torch.int32).pin_memory()
        for b in self.buckets:
            rt, tasks, plan = (self.rt, self.tasks, self.plan) if b == 1 else \
                (self.rt_many, self.tasks_many, self.plan_many)
            nodes = rt.workers
            buffers = StepBuffers.allocate(self.config, plan, b, self.width, dtype, self.device, nodes)
            self.graphs[b] = build_decode_graph(rt, tasks, plan, self.config, self.w, self.kv, self.cos, self.sin,
                                                buffers, b, self.width, nodes)
            if self.fused_upto:     # the same buffers: a bucket's graphs never run at once
                self.fused[b] = build_decode_graph(rt, tasks, plan, self.config, self.w, self.kv, self.cos, self.sin,
                                                   buffers, b, self.width, nodes, fused=True)
        # Placed and uploaded now, not on its first step: a single request (`warploop generate`) would
        # otherwise pay the placement of thousands of nodes inside its first decode step (0.45 s
        # for the tiny model on an H100: 3.8 instead of 1.0 ms/token over 64 tokens). Larger
        # buckets compile on first use.
        self.graphs[self.buckets[0]].graph.compile()
        if self.fused_upto:
            self.fused[self.buckets[0]].graph.compile()

    def _use(self, dg: DecodeGraph) -> None:
        """Before running `dg`: park every other resident kernel of this backend (on a GPU each may
        hold every SM slot, and a graph waits for the kernel of its own runtime)."""
        if self.device.type != "cuda":
            return
        for rt in self.runtimes:
            if rt is not dg.graph.runtime:
                rt.park()

    def graph_for(self, rows: int, longest: int) -> DecodeGraph:
        """The graph of the smallest bucket holding `rows`, in its form for a longest context of
        `longest` tokens."""
        b = next(b for b in self.buckets if b >= rows)
        return self.fused[b] if b in self.fused and longest <= self.fused_upto else self.graphs[b]

    def on_graph(self, batch: ModelBatch) -> bool:
        return self.rt is not None and batch.is_decode and batch.logits_indices is None \
            and batch.num_seqs <= self.buckets[-1]

    def forward(self, batch: ModelBatch) -> torch.Tensor:
        if not self.on_graph(batch):
            return self.per_op_forward(batch)
        return self.decode(batch)

    def per_op_forward(self, batch: ModelBatch) -> torch.Tensor:
        """A batch off the graph (a prefill) on the per-op backend. The resident kernel is parked
        first: its workers may hold every SM slot, and the per-op kernels (or a CUDA module's first
        load, which synchronises the context) would otherwise queue until it parks on its own."""
        if self.device.type == "cuda":
            for rt in self.runtimes:
                rt.park()
        return self.per_op.forward(batch)

    def forward_sample(self, batch: ModelBatch, seqs: list) -> torch.Tensor:
        """Decode steps: the graph's own sampled ids; rows it marks -1 and every other batch (prefill,
        a batch past the largest bucket): the host sampler over the logits."""
        if not self.on_graph(batch):
            return sample_on_device(self.per_op_forward(batch), seqs)
        sampling = tuple(self.row_sampling(seq, n) for seq, n in zip(seqs, batch.context_lens, strict=True))
        history = tuple(tuple(sorted(set(seq.token_ids))) if r.repetition_penalty != 1.0 else ()
                        for seq, r in zip(seqs, sampling, strict=True))
        self.decode(batch, sampling, history if any(history) else (), logits=False)
        n = len(seqs)
        tokens = self.last.buffers.tokens[:n]
        if self.copy_stream is not None:
            # through pinned memory on the copy stream: no kernel on the SMs the resident kernel holds
            with torch.cuda.stream(self.copy_stream):
                self.host_tokens[:n].copy_(tokens, non_blocking=True)
            self.copy_stream.synchronize()
            tokens = self.host_tokens[:n]
        tokens = tokens.to(torch.int64)
        # rows the graph could not draw, and rows drawing a prompt's first token (a prefill whose other
        # tokens were cached is one token, a decode batch's shape): every first token comes from the host
        # sampler, so a seeded request draws the same whether or not its prefix was cached
        missed = sorted(set((tokens < 0).nonzero().flatten().tolist()) | set(first_token_rows(batch, seqs)))
        if missed:      # the graph already applied these rows' penalty to the logits
            if self.device.type == "cuda":
                self.last.graph.runtime.park()  # the host sampler's kernels need SM slots (it may hold all)
            rows = [SampleRow.of(seqs[i], repetition_penalty=1.0) for i in missed]
            index = torch.tensor(missed, device=self.last.buffers.logits.device)
            tokens[torch.tensor(missed)] = sample_on_device(self.last.buffers.logits[index], rows).to(tokens.device)
        return tokens

    def row_sampling(self, seq, context_len: int) -> RowSampling:
        """A sequence's parameters for the graph: its seed, or a fresh one. The counter is the step's
        context length, not len(seq): a step launched ahead (engine overlap) runs before the host has
        appended the token before it, so only the batch knows which position is drawn; each step of
        a seeded sequence gets new noise, and a rerun, overlapped or not, the same."""
        p = seq.params
        seed = p.seed if p.seed is not None else int(self.seeds.integers(0, 2 ** 63))
        return RowSampling(p.temperature, p.top_k, p.top_p, p.min_p, p.repetition_penalty, seed,
                           context_len % 2 ** 31)

    def decode(self, batch: ModelBatch, sampling: tuple = (), history: tuple = (),
               logits: bool = True) -> torch.Tensor | None:
        """One decode step on the graph; float32 logits [num_seqs, vocab] (penalised where a row has a
        repetition penalty), copied out of the graph's buffer (logits=False: none, the graph's
        buffers hold the step's results). `sampling` and `history`: per row, as in StepInputs
        (default: greedy)."""
        dg = self.step_inputs(batch, sampling, history)
        self._use(dg)
        dg.graph.run(timeout=self.options.timeout)
        self.last = dg
        return dg.buffers.logits[:batch.num_seqs].clone() if logits else None

    def step_inputs(self, batch: ModelBatch, sampling: tuple = (), history: tuple = (),
                    steps: int = 1) -> DecodeGraph:
        """Write a decode batch's step inputs into the graph of its bucket (in the form for its
        longest context over `steps` steps); returns that graph."""
        dg = self.graph_for(batch.num_seqs, max(batch.context_lens) + steps - 1)
        if self.device.type == "cuda":
            # the sampler of the step before read this graph's logits on the default stream, and
            # device-side token ids come from it: let it finish (the resident kernel is not on it)
            torch.cuda.current_stream(self.device).synchronize()
        ids = batch.token_ids.tolist() if isinstance(batch.token_ids, torch.Tensor) else list(batch.token_ids)
        slots = batch.slot_mapping(self.layout.block_size).tolist()
        step = StepInputs(dg.batch, dg.width, tuple(ids), tuple(batch.positions), tuple(batch.context_lens),
                          tuple(slots), tuple(tuple(t) for t in batch.block_tables), sampling, history,
                          dg.history_width)
        # the history travels only when a row is penalised
        self.upload(dg.buffers.inp, step.serialize()[:step.used_words], self.host_inputs)
        return dg

    def upload(self, dst: torch.Tensor, words: np.ndarray, staging: torch.Tensor | None) -> None:
        """dst[:len(words)] = words: on a GPU a copy through pinned `staging`, not a kernel: it runs
        beside the resident kernel on a stream of its own."""
        if self.copy_stream is None:
            dst.numpy()[:len(words)] = words
            return
        staging.numpy()[:len(words)] = words
        with torch.cuda.stream(self.copy_stream):
            dst[:len(words)].copy_(staging[:len(words)], non_blocking=True)
        self.copy_stream.synchronize()

    # -- the decode loop on the GPU (loop.py) ---------------------------------------------------------
    def loop_ready(self, batch: ModelBatch, seqs: list) -> bool:
        """Whether this decode batch can run as a loop on the GPU: on a graph, and no row needs the
        host between steps (a repetition penalty's history of previous tokens grows each step)."""
        return self.on_graph(batch) and all(s.params.repetition_penalty == 1.0 for s in seqs)

    def start_loop(self, batch: ModelBatch, seqs: list, steps: int, remaining: list[int],
                   stops: list[list[int]], free: list[int]) -> LoopRun:
        """Run up to `steps` decode steps of `batch` inside the resident kernel, the first from the
        batch's inputs, each next one from the tokens the one before sampled; returns at once.
        remaining: per row, the most tokens it may make; stops: per row, the ids that stop it;
        free: KV blocks the rows take from, in order, as they cross block boundaries."""
        if not 1 <= steps <= MAX_STEPS:
            raise ValueError(f"a decode loop runs 1 to {MAX_STEPS} steps, not {steps}")
        sampling = tuple(self.row_sampling(seq, n) for seq, n in zip(seqs, batch.context_lens, strict=True))
        dg = self.step_inputs(batch, sampling, steps=steps)
        block = loop_block(dg.batch, self.plan.block_size)
        self.upload(dg.buffers.loop, block.serialize(steps, remaining, stops, free), self.host_loop)
        run = LoopRun(dg.graph, dg.buffers.mail, Mailbox(dg.batch, MAX_STEPS), batch.num_seqs, dg.graph.runtime,
                      self.options.timeout)
        self.last = dg
        self._use(dg)
        run.start(repeat=steps)
        return run

    def loop_logits(self, rows: list[int]) -> torch.Tensor:
        """The latest step's logits of these rows (a loop that ended for host sampling)."""
        index = torch.tensor(rows, device=self.last.buffers.logits.device)
        return self.last.buffers.logits[index]

    def last_greedy_tokens(self) -> list[int]:
        """The graph's own pick for each sequence of the latest decode step (the argmax for a step
        run through `forward`)."""
        if self.last is None:
            raise RuntimeError("no decode step has run on the megakernel yet")
        return self.last.buffers.tokens[:int(self.last.buffers.inp[F_ROWS])].tolist()

    def close(self) -> None:
        for rt in self.runtimes:
            rt.close()
        self.rt = self.rt_many = None
