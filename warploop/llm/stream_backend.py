"""StreamBackend: decode on the streaming executor (warploop/runtime/stream); prefill per op.

Under the Backend contract (backend.py): a decode batch of one sequence runs as one step of the
model's streaming program (llm/stream_step.py) over the same paged KV cache the per-op backend's
prefill writes. With `rows` (WARPLOOP_STREAM_ROWS), decode batches of 2 to `rows` sequences run on a
second program of that many rows (its GEMVs on tensor cores, rows past the batch idle); without, and
for every other batch, the per-op TorchBackend runs it. Greedy sequences run decode loops on the
device (`start_loop`): up to MAX_STEPS steps in one launch, each step's tokens picked on the GPU and
fed to the next step's embeddings, the host writing only the first tokens, the positions and the
block tables (each sequence's blocks and the ones it takes from the loan for the steps ahead). A
single sequence sampled at a temperature alone (no top-k, top-p, min-p or penalty) is drawn on the
GPU too, by Gumbel-max (runtime/stream/philox.py: its seed and position give its token), in loops
and single steps alike; other sampled sequences take single steps, sampled on the host.

The kernel runs every step of a launch for every row; a launch runs at most the smallest budget
of its rows, and the host applies each row's stop ids to the tokens it reads back (a token after the
row stopped is dropped, and so is the block it would have taken: the engine gives that block back).

On the CPU the program runs on the streaming executor's CPU reference: a check, not a speed.
"""
from __future__ import annotations

import sys
import threading
import time

import numpy as np
import torch

from warploop.llm.backend import Backend, ModelBatch, first_token_rows
from warploop.llm.backend_torch import TorchBackend
from warploop.llm.config import ModelConfig
from warploop.llm.kv_cache import KVCacheLayout, cdiv
from warploop.llm.loop_step import NO_TOKEN
from warploop.llm.stream_pools import pack_pools
from warploop.llm.stream_step import StreamDecoder, unsupported
from warploop.llm.weights import ModelWeights

MAX_STEPS = 32            # a loop's most steps: an arrival waits at most this many for its turn
COMPILE_NOTICE_S = 5.0
COMPILE_NOTICE = ("warploop: compiling the streaming kernel for this model shape (the first start of a shape takes "
                  "up to a minute on a GPU; later starts read Triton's cache)")


def greedy(seq) -> bool:
    """Whether the device's pick (the argmax) is this sequence's: greedy, nothing that reshapes logits."""
    p = seq.params
    return p.temperature == 0 and p.repetition_penalty == 1.0


def device_sampled(seq) -> bool:
    """Whether the kernel draws this sequence's token (one row): temperature alone, by Gumbel-max
    (runtime/stream/philox.py); top-k, top-p, min-p and repetition penalties sample on the host."""
    p = seq.params
    return p.temperature > 0 and p.top_k == 0 and p.top_p == 1.0 and p.min_p == 0.0 and p.repetition_penalty == 1.0


def _tokens(batch: ModelBatch) -> list[int]:
    """The batch's token ids on the host (one copy when an overlapped step left them on the device)."""
    ids = batch.token_ids
    return [int(t) for t in (ids.tolist() if isinstance(ids, torch.Tensor) else ids)]


class StreamBackend(Backend):
    name = "stream"

    def __init__(self, config: ModelConfig, weights: ModelWeights, layout: KVCacheLayout, device, max_context: int,
                 splits: int | None = None, timeout: float = 60.0, use_cuda_graphs: bool = True,
                 pools=None, rows: int = 0, prebuilt=None, per_op: Backend | None = None,
                 decoder: StreamDecoder | None = None) -> None:
        """use_cuda_graphs: the per-op path's decode batches replay CUDA graphs (captured in warmup), as
        on the per-op backend. pools: stream_pools.pack_pools(weights, device, share=True)'s result
        (build_backend packs them before sizing the KV cache), else packed here, a copy beside the
        weights. rows: decode batches of 2 to `rows` sequences on the stream too (0: per op).
        prebuilt: where the stream kernels come from (WARPLOOP_STREAM_PREBUILT: "auto", "off" or a folder
        of prebuilt kernels launched with no compiler; stream_shipped.prebuilt_folder).
        per_op and decoder: built by the caller (tensor parallelism: tp/build.py gives the ranks'
        per-op backend and a decoder that has every rank run each launch; `weights` is then unused)."""
        super().__init__(config, layout, torch.device(device))
        why = unsupported(config, layout.dtype)
        if why:
            hint = "load it with --dtype bfloat16, or use" if layout.dtype != "bfloat16" else "use"
            raise ValueError(f"the streaming backend cannot run this model: {why}; {hint} --backend torch")
        if self.device.type == "cuda" and torch.cuda.get_device_capability(self.device)[0] != 9:
            raise ValueError("the streaming backend runs on Hopper GPUs (H100, H200) and the CPU: use --backend torch")
        if rows == 1 or rows < 0:
            raise ValueError(f"rows={rows}: use 0 (batches per op) or 2 to 32")
        if (per_op is None) != (decoder is None) or (decoder is not None and rows):
            raise ValueError("per_op and decoder come together, and with them no batched decoder (rows=0)")
        if per_op is None:
            per_op = TorchBackend(config, weights, layout, device, max_context, use_cuda_graphs=use_cuda_graphs)
            t0 = time.perf_counter()
            pools = pools or pack_pools(weights, self.device)
            t1 = time.perf_counter()
            decoder = StreamDecoder(config, weights, device=self.device, max_context=max_context,
                                    block_size=layout.block_size, splits=splits, kv=per_op.kv,
                                    pools=pools, prebuilt=prebuilt, defer=True)
            # the start's parts here (Engine.start_s): packing the weight pools, then recording the step's
            # program, placing it on the SMs and checking it (the smallest split level; the rest defer)
            self.start_s = {"pack": t1 - t0, "place": time.perf_counter() - t1}
        self.per_op, self.decoder = per_op, decoder
        self.rows = None             # the decoder of batches, over the same pools and cache
        if rows:
            self.rows = StreamDecoder(config, weights, device=self.device, max_context=max_context,
                                      block_size=layout.block_size, kv=self.per_op.kv, pools=pools, batch=rows,
                                      prebuilt=prebuilt, defer=True)
        self.max_context, self.timeout = max_context, timeout
        self.last = self.decoder         # the decoder of the latest loop
        self.seeds = np.random.default_rng()     # a fresh seed a launch for sampled rows that ask for none

    def on_stream(self, batch: ModelBatch) -> bool:
        return (batch.is_decode and batch.logits_indices is None
                and (batch.num_seqs == 1 or (self.rows is not None and batch.num_seqs <= self.rows.batch)))

    def _decoder(self, batch: ModelBatch) -> StreamDecoder:
        return self.decoder if batch.num_seqs == 1 else self.rows

    def forward(self, batch: ModelBatch) -> torch.Tensor:
        if not self.on_stream(batch):
            return self.per_op.forward(batch)
        tokens = _tokens(batch)
        if batch.num_seqs == 1:
            return self.decoder.step(tokens[0], batch.positions[0], batch.block_tables[0])[None].clone()
        return self.rows.step_rows(tokens, list(batch.positions), [list(t) for t in batch.block_tables]) \
            [:batch.num_seqs].clone()

    # -- the decode loop on the device ------------------------------------------------------------
    def loop_ready(self, batch: ModelBatch, seqs: list) -> bool:
        return self.on_stream(batch) and (all(greedy(seq) for seq in seqs)
                                          or (batch.num_seqs == 1 and device_sampled(seqs[0])))

    def _sampling(self, seq) -> tuple | None:
        """The kernel's sampling of a one-row step: (temperature, seed), the request's seed or a fresh
        one (a seeded request's token at a position is a function of its seed: loops and single steps
        draw alike); None for greedy rows."""
        if not device_sampled(seq):
            return None
        p = seq.params
        return p.temperature, p.seed if p.seed is not None else int(self.seeds.integers(0, 2 ** 63))

    def forward_sample(self, batch: ModelBatch, seqs: list):
        # a prompt's first token (one uncached prompt token is a decode row's shape) samples on the host, as
        # every prefill's does (backend.first_token_rows)
        if (self.on_stream(batch) and batch.num_seqs == 1 and device_sampled(seqs[0])
                and not first_token_rows(batch, seqs)):
            self.decoder.step(_tokens(batch)[0], batch.positions[0], batch.block_tables[0],
                              sampling=self._sampling(seqs[0]))
            return torch.tensor(self.decoder.tokens(1), dtype=torch.int64, device=self.device)
        return super().forward_sample(batch, seqs)

    def start_loop(self, batch: ModelBatch, seqs: list, steps: int, remaining: list[int], stops: list[list[int]],
                   free: list[int]) -> StreamLoopRun:
        # the kernel runs every step for every row: no row may pass its budget (or the context)
        steps = min(steps, MAX_STEPS, min(remaining))
        bs, n = self.layout.block_size, batch.num_seqs
        tables = [list(t) for t in batch.block_tables]
        # step s makes each row's token at pos + s + 1; where that position opens a block, the row
        # takes the next lent one (the kernel writes k and v at pos .. pos + steps - 1, the last
        # token's block joins the table for the step after the loop)
        takes = []
        lent = iter(free)
        for s in range(steps):
            step = []
            for r in range(n):
                at = batch.positions[r] + s + 1
                step.append(next(lent, None) if at % bs == 0 and at < self.max_context else -1)
            if None in step:               # a row has no block for this step's token: the loop ends before it
                steps = s
                break
            takes.append(step)
            for r, block in enumerate(step):
                if block >= 0:
                    tables[r].append(block)
        if steps < 1:
            raise RuntimeError("no KV block for the loop's first token")
        tokens = _tokens(batch)
        kernel_tables = [t[:cdiv(p + steps, bs)] for t, p in zip(tables, batch.positions, strict=True)]
        self.last = self._decoder(batch)
        sampling = self._sampling(seqs[0]) if n == 1 else None
        self.last.launch_rows(tokens, list(batch.positions), steps, kernel_tables, sampling=sampling)
        return StreamLoopRun(self.last, steps, takes, remaining, [set(s) for s in stops], self.timeout)

    def loop_logits(self, rows: list[int]) -> torch.Tensor:
        return self.last.logits()[rows].clone()

    def close(self) -> None:
        self.per_op.close()

    def idle(self) -> bool:
        """One deferred split level's program (StreamDecoder defer=True), while the engine is idle."""
        return any(d.build_deferred() for d in (self.decoder, self.rows) if d is not None)

    def warmup(self, max_num_seqs: int) -> None:
        self.per_op.warmup(max_num_seqs)
        if self.device.type == "cuda":
            # the kernels compile on their first launch (up to a minute): here, not in a request, and
            # a start that compiles says so and why (one served from Triton's cache or from prebuilt
            # kernels returns before the notice is due). They write k and v rows into block 0, which
            # no sequence holds yet
            why = "; ".join(sorted({d.compiles for d in (self.decoder, self.rows) if d is not None and d.compiles}))
            notice = threading.Timer(COMPILE_NOTICE_S, lambda: print(
                COMPILE_NOTICE + (f" ({why})" if why else ""), file=sys.stderr, flush=True))
            notice.daemon = True
            notice.start()
            try:
                self.decoder.step(0, 0, [0])
                if self.rows is not None:
                    self.rows.step_rows([0, 0], [0, 0], [[0], [0]])
            finally:
                notice.cancel()


class StreamLoopRun:
    """The host's side of a decode loop launch (loop_step.LoopStep.run): the tokens come back when
    the launch ends, each row's cut at its budget and its first stop id; halt() has nothing to stop
    (the launch is at most MAX_STEPS steps)."""

    def __init__(self, decoder: StreamDecoder, steps: int, takes: list[list[int]], budgets: list[int],
                 stops: list[set], timeout: float) -> None:
        import time
        self.decoder, self.steps, self.takes, self.budgets, self.stops = decoder, steps, takes, budgets, stops
        self.timeout = timeout
        self.taken = False
        self.started = time.perf_counter()

    def halt(self) -> None:
        pass

    def finished(self) -> bool:
        return self.taken

    def take(self, wait_s: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
        """Every step's (token, block) of every row once the launch has ended ([steps, rows] each;
        NO_TOKEN and block -1 after a row's budget or first stop id); before that, and after the
        first take, none."""
        import time
        rows = len(self.budgets)
        if self.taken or (not self.decoder.done() and not self._wait(wait_s)):
            if not self.taken and time.perf_counter() - self.started > self.timeout:
                self.decoder.wait(0.0)           # raises TimeoutError: the launch outlived its watchdog
            return np.zeros((0, rows), np.int32), np.zeros((0, rows), np.int32)
        self.decoder.wait(self.timeout)          # raises the kernel's fault, if any
        self.taken = True
        made = self.decoder.row_tokens(self.steps)[:rows]
        tokens = np.full((self.steps, rows), NO_TOKEN, np.int32)
        blocks = np.full((self.steps, rows), -1, np.int32)
        last = 0
        for r in range(rows):
            n = 0
            while n < min(self.steps, self.budgets[r]):
                tokens[n, r], blocks[n, r] = made[r][n], self.takes[n][r]
                n += 1
                if made[r][n - 1] in self.stops[r]:
                    break
            last = max(last, n)
        return tokens[:last], blocks[:last]

    def _wait(self, wait_s: float) -> bool:
        import time
        end = time.perf_counter() + wait_s
        while time.perf_counter() < end:
            if self.decoder.done():
                return True
            time.sleep(50e-6)
        return self.decoder.done()
