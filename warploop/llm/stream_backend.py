"""StreamBackend: batch-1 decode on the streaming executor (warploop/runtime/stream); the rest per op.

Under the Backend contract (backend.py): a decode batch of one sequence runs as one step of the
model's streaming program (llm/stream_step.py) over the same paged KV cache the per-op backend's
prefill writes; every other batch runs on the per-op TorchBackend. A greedy sequence runs decode
loops on the device (`start_loop`): up to MAX_STEPS steps in one launch, each step's token picked on
the GPU and fed to the next step's embedding, the host writing only the first token, the position
and the block table (the sequence's blocks and the ones it takes from the loan for the steps ahead).

The kernel runs every step of a launch; the host applies the row's budget and stop ids to the
tokens it reads back (a token after the row stopped is dropped, and so is the block it would have
taken: the engine gives that block back).

On the CPU the program runs on the streaming executor's CPU reference: a check, not a speed.
"""
from __future__ import annotations

import numpy as np
import torch

from warploop.llm.backend import Backend, ModelBatch
from warploop.llm.backend_torch import TorchBackend
from warploop.llm.config import ModelConfig
from warploop.llm.kv_cache import KVCacheLayout, cdiv
from warploop.llm.stream_step import StreamDecoder, unsupported
from warploop.llm.weights import ModelWeights

MAX_STEPS = 32            # a loop's most steps: an arrival waits at most this many for its turn


def greedy(seq) -> bool:
    """Whether the device's pick (the argmax) is this sequence's: greedy, nothing that reshapes logits."""
    p = seq.params
    return p.temperature == 0 and p.repetition_penalty == 1.0


class StreamBackend(Backend):
    name = "stream"

    def __init__(self, config: ModelConfig, weights: ModelWeights, layout: KVCacheLayout, device, max_context: int,
                 splits: int | None = None, timeout: float = 60.0, use_cuda_graphs: bool = True,
                 pools=None) -> None:
        """use_cuda_graphs: the per-op path's decode batches (2 sequences and more) replay CUDA graphs
        (captured in warmup), as on the per-op backend. pools: stream_step.pack_pools(weights, device,
        share=True)'s result (build_backend packs them before sizing the KV cache), else packed here,
        a copy beside the weights."""
        super().__init__(config, layout, torch.device(device))
        why = unsupported(config, layout.dtype)
        if why:
            hint = "load it with --dtype bfloat16, or use" if layout.dtype != "bfloat16" else "use"
            raise ValueError(f"the streaming backend cannot run this model: {why}; {hint} --backend torch")
        if self.device.type == "cuda" and torch.cuda.get_device_capability(self.device)[0] != 9:
            raise ValueError("the streaming backend runs on Hopper GPUs (H100, H200) and the CPU: use --backend torch")
        self.per_op = TorchBackend(config, weights, layout, device, max_context, use_cuda_graphs=use_cuda_graphs)
        self.decoder = StreamDecoder(config, weights, device=self.device, max_context=max_context,
                                     block_size=layout.block_size, splits=splits, kv=self.per_op.kv,
                                     pools=pools)
        self.max_context, self.timeout = max_context, timeout
        self.last_logits = None

    def on_stream(self, batch: ModelBatch) -> bool:
        return batch.is_decode and batch.num_seqs == 1 and batch.logits_indices is None

    def forward(self, batch: ModelBatch) -> torch.Tensor:
        if not self.on_stream(batch):
            return self.per_op.forward(batch)
        token = batch.token_ids[0] if not isinstance(batch.token_ids, torch.Tensor) else int(batch.token_ids[0])
        logits = self.decoder.step(int(token), batch.positions[0], batch.block_tables[0])
        return logits[None].clone()

    # -- the decode loop on the device ------------------------------------------------------------
    def loop_ready(self, batch: ModelBatch, seqs: list) -> bool:
        return self.on_stream(batch) and greedy(seqs[0])

    def start_loop(self, batch: ModelBatch, seqs: list, steps: int, remaining: list[int], stops: list[list[int]],
                   free: list[int]) -> StreamLoopRun:
        steps = min(steps, MAX_STEPS, remaining[0])
        bs = self.layout.block_size
        pos = batch.positions[0]
        table = list(batch.block_tables[0])
        # step s makes the token at pos + s + 1; where that position opens a block, it takes the
        # next lent one (the kernel writes k and v at pos .. pos + steps - 1, the last token's block
        # joins the table for the step after the loop)
        takes = []
        lent = iter(free)
        for s in range(steps):
            if (pos + s + 1) % bs == 0 and pos + s + 1 < self.max_context:
                block = next(lent, None)
                if block is None:             # no block for this step's token: the loop ends before it
                    steps = s
                    break
                takes.append(block)
                table.append(block)
            else:
                takes.append(-1)
        if steps < 1:
            raise RuntimeError("no KV block for the loop's first token")
        token = batch.token_ids[0] if not isinstance(batch.token_ids, torch.Tensor) else int(batch.token_ids[0])
        kernel_table = table[:cdiv(pos + steps, bs)]
        self.decoder.launch(int(token), pos, steps, kernel_table)
        return StreamLoopRun(self.decoder, steps, takes, remaining[0], set(stops[0]), self.timeout)

    def loop_logits(self, rows: list[int]) -> torch.Tensor:
        return self.decoder.view("logits")[None].clone()

    def warmup(self, max_num_seqs: int) -> None:
        self.per_op.warmup(max_num_seqs)
        if self.device.type == "cuda":
            # the kernel compiles on its first launch (seconds): here, not in a request. It writes a
            # k and v row into block 0, which no sequence holds yet
            self.decoder.step(0, 0, [0])


class StreamLoopRun:
    """The host's side of a decode loop launch (loop_step.LoopStep.run): the tokens come back when
    the launch ends, cut at the row's budget and its first stop id; halt() has nothing to stop
    (the launch is at most MAX_STEPS steps)."""

    def __init__(self, decoder: StreamDecoder, steps: int, takes: list[int], budget: int, stops: set,
                 timeout: float) -> None:
        import time
        self.decoder, self.steps, self.takes, self.budget, self.stops = decoder, steps, takes, budget, stops
        self.timeout = timeout
        self.taken = False
        self.started = time.perf_counter()

    def halt(self) -> None:
        pass

    def finished(self) -> bool:
        return self.taken

    def take(self, wait_s: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
        """Every step's (token, block) once the launch has ended ([steps, 1] each); before that, and
        after the first take, none."""
        import time
        if self.taken or (not self.decoder.done() and not self._wait(wait_s)):
            if not self.taken and time.perf_counter() - self.started > self.timeout:
                self.decoder.wait(0.0)           # raises TimeoutError: the launch outlived its watchdog
            return np.zeros((0, 1), np.int32), np.zeros((0, 1), np.int32)
        self.decoder.wait(self.timeout)          # raises the kernel's fault, if any
        self.taken = True
        tokens = self.decoder.tokens(self.steps)
        n = 0
        while n < min(self.steps, self.budget):
            n += 1
            if tokens[n - 1] in self.stops:
                break
        return (np.array(tokens[:n], np.int32).reshape(n, 1), np.array(self.takes[:n], np.int32).reshape(n, 1))

    def _wait(self, wait_s: float) -> bool:
        import time
        end = time.perf_counter() + wait_s
        while time.perf_counter() < end:
            if self.decoder.done():
                return True
            time.sleep(50e-6)
        return self.decoder.done()
