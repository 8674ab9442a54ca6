"""The per-op backend: the model as a sequence of PyTorch ops (CPU and GPU) over the paged KV cache.

On a GPU the elementwise work and decode attention run as the Triton kernels of triton_ops.py and
paged_attention.py (their kernels in ops_kernels.py, launched from the bundle the package ships where
it fits, so no compiler runs: ops_prebuilt.py), and decode steps replay CUDA graphs captured per
batch-size bucket (cuda_graphs.py); prefill attention goes through torch's
scaled_dot_product_attention. On the CPU every op is the plain PyTorch version from layers.py.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from warploop import config as env_config
from warploop.llm import layers
from warploop.llm.backend import Backend, ModelBatch
from warploop.llm.config import ModelConfig
from warploop.llm.kv_cache import KVCacheLayout
from warploop.llm.rope import cos_sin_table
from warploop.llm.weights import ModelWeights


class TorchBackend(Backend):
    def __init__(self, config: ModelConfig, weights: ModelWeights, layout: KVCacheLayout, device,
                 max_context: int, use_triton: bool | None = None, use_cuda_graphs: bool = True) -> None:
        super().__init__(config, layout, torch.device(device))
        self.w = weights
        self.dtype = weights.embed.dtype
        self.max_context = max_context
        # zeros, not empty: the CPU path reads whole (masked) blocks, and 0 * NaN garbage would be NaN
        self.kv = torch.zeros(layout.shape, dtype=self.dtype, device=self.device)
        self.cos, self.sin = cos_sin_table(config.rope, config.head_dim, max_context, self.device)
        self.scale = config.head_dim ** -0.5
        on_gpu = self.device.type == "cuda"
        if use_triton is None:  # the kernels need power-of-two heads of 16 or more (tl.arange, tl.dot)
            use_triton = on_gpu and config.head_dim >= 16 and config.head_dim & (config.head_dim - 1) == 0
        self.use_triton = use_triton
        self.use_cuda_graphs = use_cuda_graphs and on_gpu and use_triton
        self.workspace = None   # split-K scratch of the Triton decode attention
        # prefill attends from the pages in one Triton launch (paged_attention.prefill_attention), fresh
        # prompts and cached prefixes alike ("all"). H200, `bench prefill` 2026-11-29: a prefix hit 2.4-2.7x
        # faster than a gathered context with a dense mask ("off"); a fresh 1,024-token prompt 1.34-1.35x
        # faster than SDPA, 0.85-0.92x at 4k-16k tokens on Llama-3.2-1B; and SDPA's own backend choice
        # (cuDNN) builds a plan for each prompt length it has not seen, 74-167 ms at the first prefill of
        # a length against the paged kernel's 12-116 ms (warm 6.7-117). "prefix": SDPA for fresh prompts
        # and the paged kernel for the rest; "off": SDPA everywhere. Only with the Triton kernels (a GPU)
        self.paged_prefill = "all" if use_triton else "off"
        self.bucket_rows = not on_gpu and self.dtype in (torch.bfloat16, torch.float16)   # see _linear
        if use_triton:
            from warploop.llm import triton_ops
            self.ops = triton_ops
        else:
            self.ops = layers
        self.graphs = None
        self.prefill_graphs = None   # cuda_graphs.PrefillGraphs (WARPLOOP_PREFILL_GRAPHS; a GPU with CUDA graphs)

    @property
    def max_blocks_per_seq(self) -> int:
        return -(self.max_context // -self.layout.block_size)

    def warmup(self, max_num_seqs: int) -> None:
        if self.use_triton:
            self._ensure_workspace(max_num_seqs)
        if self.device.type == "cuda":
            self.warm_prefill()
        if self.use_cuda_graphs:
            from warploop.llm.cuda_graphs import DecodeGraphs
            self.graphs = DecodeGraphs(self, max_num_seqs)
            self.graph_prefills()

    def graph_prefills(self) -> None:
        """Prefill prompts of up to WARPLOOP_PREFILL_GRAPHS tokens through CUDA graphs (PrefillGraphs),
        where the GPU's Triton kernels run: warmup does it with use_cuda_graphs, and a backend whose
        per-op half takes only prefills (the megakernel's) calls it itself."""
        from warploop.llm.cuda_graphs import PrefillGraphs
        tokens = min(env_config.get().prefill_graphs, self.max_context)
        if tokens and self.prefill_graphs is None and self.device.type == "cuda" and self.use_triton:
            self.prefill_graphs = PrefillGraphs(self, tokens)

    def warm_prefill(self, tokens: int = 8) -> None:
        """One throwaway prefill (and the host sampler's argmax), so the first real one does not
        load and JIT its kernels: `warploop generate` on the tiny model, H100, first token 0.78 s
        before this on the megakernel backend (whose prefill is this path, with the resident kernel
        starting after), 0.08 s after. It writes KV block 0, which holds nothing yet."""
        tokens = min(tokens, self.layout.block_size)      # within block 0
        self._eager(ModelBatch([1] * tokens, list(range(tokens)), [tokens], [tokens], [[0]])).argmax(-1)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def close(self) -> None:
        """Destroy the CUDA graphs now (DecodeGraphs.release: a graph that captured an NCCL collective
        keeps its communicator alive, so tensor parallelism closes this before leaving its group)."""
        for graphs in (self.graphs, self.prefill_graphs):
            if graphs is not None:
                graphs.release()
                if self.device.type == "cuda":    # PrefillGraphs run off a GPU too (the tests), graphless
                    torch.cuda.synchronize(self.device)
        self.graphs = self.prefill_graphs = None

    def forward(self, batch: ModelBatch) -> torch.Tensor:
        if (self.graphs is not None and batch.is_decode and batch.logits_indices is None
                and batch.num_seqs <= self.graphs.max_batch):
            return self.graphs.run(batch)
        if self.prefill_graphs is not None and self.prefill_graphs.fits(batch) and self._paged(batch):
            return self.prefill_graphs.run(batch)
        return self._eager(batch)

    def _eager(self, batch: ModelBatch) -> torch.Tensor:
        dev = self.device

        def ints(values):
            return torch.as_tensor(values, dtype=torch.int32).to(dev, non_blocking=True)

        on_device = isinstance(batch.token_ids, torch.Tensor)
        ids = batch.token_ids.to(dev, torch.int32) if on_device else ints(batch.token_ids)
        positions = ints(batch.positions)
        slots = ints(batch.slot_mapping(self.layout.block_size))
        rows = ints(batch.rows_for_logits())
        if batch.is_decode:
            width = max(len(t) for t in batch.block_tables)
            tables = ints([t + [0] * (width - len(t)) for t in batch.block_tables])
            return self.decode(ids, positions, slots, ints(batch.context_lens), tables, rows)
        if self._paged(batch):
            from warploop.llm.paged_attention import PrefillPlan
            plan = PrefillPlan(batch.block_tables, batch.query_lens, batch.context_lens, dev)
            return self.paged_forward(ids, positions, slots, rows, plan)
        tables = [ints(t) for t in batch.block_tables]

        def attend(layer, q, k, v):
            return layers.prefill_attention(q, k, v, self.kv[layer, 0], self.kv[layer, 1], tables,
                                            batch.query_lens, batch.context_lens, self.scale)

        return self._logits(*self._layers(ids, positions, slots, attend), rows)

    def _paged(self, batch: ModelBatch) -> bool:
        """Whether a prefill batch attends from the pages (paged_prefill)."""
        return self.use_triton and (self.paged_prefill == "all" or (self.paged_prefill == "prefix"
                                                                    and batch.context_lens != batch.query_lens))

    def paged_forward(self, ids, positions, slots, rows, plan) -> torch.Tensor:
        """A prefill attending from the pages through `plan` (paged_attention.PrefillPlan), on device
        tensors only (no host sync): what the prefill graphs capture."""
        from warploop.llm.paged_attention import prefill_attention

        def attend(layer, q, k, v):
            return prefill_attention(q, self.kv[layer, 0], self.kv[layer, 1], plan, self.scale)

        return self._logits(*self._layers(ids, positions, slots, attend), rows)

    def decode(self, ids, positions, slots, context_lens, block_tables, rows=None) -> torch.Tensor:
        """One token per sequence, on device tensors only (no host sync): what CUDA graphs capture."""
        if self.use_triton:
            from warploop.llm.paged_attention import decode_attention
            self._ensure_workspace(ids.shape[0])

            def attend(layer, q, k, v):
                return decode_attention(q, self.kv[layer, 0], self.kv[layer, 1], block_tables, context_lens,
                                        self.scale, self.workspace)
        else:
            def attend(layer, q, k, v):
                return layers.decode_attention(q, self.kv[layer, 0], self.kv[layer, 1], block_tables, context_lens,
                                               self.scale)

        x, residual = self._layers(ids, positions, slots, attend)
        return self._logits(x, residual, rows)

    def _ensure_workspace(self, batch: int) -> None:
        if self.workspace is None or self.workspace.out.shape[0] < batch:
            from warploop.llm.paged_attention import DecodeWorkspace
            longest = self.max_blocks_per_seq * self.layout.block_size
            self.workspace = DecodeWorkspace(batch, self.config.num_heads, self.config.head_dim, longest, self.device)

    def _linear(self, x, w, b=None):
        """F.linear; on the CPU in bfloat16 or float16, over its rows padded to a bucket (a multiple
        of 16 up to 256, of 64 beyond; 16 rows or fewer exact). oneDNN builds and keeps a kernel for
        every row count it meets in half precision (about 0.6 MB each on the CI machine), so a server's
        memory climbed with every new prompt length (tests/test_soak.py); buckets bound the counts."""
        n = x.shape[0]
        if self.bucket_rows and n > 16:
            m = -(-n // 16) * 16 if n <= 256 else -(-n // 64) * 64
            if m != n:
                return F.linear(F.pad(x, (0, 0, 0, m - n)), w, b)[:n]
        return F.linear(x, w, b)

    def _layers(self, ids, positions, slots, attend):
        cfg, ops, eps = self.config, self.ops, self.config.rms_norm_eps
        x = self._embed(ids)
        residual = None
        for i, lw in enumerate(self.w.layers):
            h, residual = ops.rms_norm(x, lw.input_norm, eps, residual)
            qkv = self._linear(h, lw.qkv, lw.qkv_bias)
            q, k, v = ops.qk_rope_cache(qkv, positions, self.cos, self.sin, self.kv[i, 0], self.kv[i, 1], slots,
                                        cfg.num_heads, cfg.num_kv_heads, lw.q_norm, lw.k_norm, eps)
            x = self._all_reduce(self._linear(attend(i, q, k, v), lw.o, lw.o_bias))
            h, residual = ops.rms_norm(x, lw.post_norm, eps, residual)
            x = self._all_reduce(self._linear(ops.silu_mul(self._linear(h, lw.gate_up, lw.gate_up_bias)), lw.down,
                                          lw.down_bias))
        return x, residual

    def _logits(self, x, residual, rows) -> torch.Tensor:
        if rows is not None:
            x, residual = x.index_select(0, rows), residual.index_select(0, rows)
        h, _ = self.ops.rms_norm(x, self.w.norm, self.config.rms_norm_eps, residual)
        return self._lm_head(h)

    # Hooks that tensor parallelism (warploop/llm/tp/backend.py) overrides; identities on one device.

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.w.embed)

    def _all_reduce(self, partial: torch.Tensor) -> torch.Tensor:
        return partial

    def _lm_head(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(h, self.w.lm_head).float()
