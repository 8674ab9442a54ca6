"""A model's batch-1 decode step as one streaming program (warploop/runtime/stream).

Every layer's qkv (input norm, bias), attention (q/k norm, RoPE, the paged KV write, GQA in splits),
o_proj (added into the residual), gate/up (post norm, SiLU x up) and down (added), then lm_head
(final norm), recorded once (llm/stream_record.py), placed once and run every step: on a Hopper GPU
by the streaming kernel, elsewhere by the CPU reference. Weights stream as bf16; activations are
float32; the KV cache is bf16.

A step starts with the token's embedding row (an EMBED node) and ends with the greedy token (each
lm_head tile's largest logit, reduced by a SAMPLE node), and the next step's EMBED waits for that
token: `generate` runs a decode loop of several steps in one launch, the host writing only the
first token, the position and the block table (covering every step) before it.

    dec = StreamDecoder(cfg, weights, device="cuda", max_context=4096)
    logits = dec.step(token_id, position)         # the sequence's blocks are 0, 1, 2, ... of dec.kv
    tokens = dec.generate(token_id, position, steps=32)     # greedy, on the GPU
"""
from __future__ import annotations

import os

from warploop import config as settings
from warploop.llm.config import ModelConfig
from warploop.llm.kv_cache import cdiv
from warploop.llm.rope import cos_sin_table
from warploop.llm.stream_pools import pack_pools
from warploop.llm.stream_record import record_step
from warploop.llm.stream_shipped import first_executor, prebuilt_folder
from warploop.llm.stream_tp import rank_config
from warploop.llm.weights import ModelWeights
from warploop.runtime.stream.arena import Region
from warploop.runtime.stream.compiled import StreamConfig

# A batched kernel's shape where it differs from StreamConfig's defaults, by batch_rows (H200,
# context 512, tokens/s; bench/results/stream-batch-wgmma-h200-20261129.jsonl):
# - at 32 rows, tiles of 64 weight rows by 128 inputs, multiplied on wgmma (against 32-row tiles on
#   mma_v2: Llama-3.2-1B 16,348 / 14,181, Qwen3-0.6B 11,174 / 10,149, SmolLM2-135M 22,747 / 18,657);
#   at 16 rows (batch 8) they measured 5,610 / 5,830, 5,089 / 4,933 and 7,262 / 7,096: not taken;
# - the ring's 8 slots and 4 stages of x (32 KB at 32 rows of 128 inputs): 4 slots and 8 stages measured
#   16,378 / 16,691 for Llama-3.2-1B, 11,534 / 11,540 for Qwen3-0.6B
# - attention on wgmma (attn_wgmma, head_dim 64; bench/results/stream-attn-wgmma-h200-20261130.jsonl), ms a
#   step against the CUDA cores' chunks: Llama-3.2-1B 1.264 -> 1.218 at batch 8, 1.699 -> 1.557 at 32 and
#   1.919 -> 1.520 at batch 8 over 4,096 tokens; SmolLM2-135M 0.994 -> 0.982 and 1.161 -> 1.025
# - at 64 rows (not timed yet): 32 rows' tiles, and 64 KB of x (4 stages of 64 rows of 128 inputs)
BATCH_SHAPES = {32: {"block_rows": 64, "block_k": 128}, 64: {"block_rows": 64, "block_k": 128, "x_stage_kb": 64}}
# - attention on wgmma (attn_wgmma) by head size: the batch_rows where it runs (measured faster; at head_dim
#   128 Qwen3-0.6B 2.347 -> 2.069 ms at batch 32, 1.463 -> 1.559 at 8;
#   bench/results/stream-attn-wgmma-hd128-h200-20261130.jsonl)
WGMMA_ATTENTION = {64: (16, 32, 64), 128: (32, 64)}        # 64 rows as 32 (not timed yet)


def stream_config(cfg: ModelConfig, block_size: int = 16, **overrides) -> StreamConfig:
    """The kernel shape a model needs: the widest input, its head size and group (and a batched
    kernel's BATCH_SHAPES, with attention on wgmma where WGMMA_ATTENTION says, over KV blocks of 8
    tokens or more); `overrides` win."""
    kmax = 256
    while kmax < max(cfg.hidden_size, cfg.q_size, cfg.intermediate_size):
        kmax *= 2
    group = 1
    while group < cfg.num_heads // cfg.num_kv_heads:
        group *= 2
    rows = overrides.get("batch_rows", 0)
    wgmma = rows in WGMMA_ATTENTION.get(cfg.head_dim, ()) and block_size >= 8
    shape = BATCH_SHAPES.get(rows, {}) | {"attn_wgmma": wgmma}
    return StreamConfig(**({"kmax": kmax, "head_dim": cfg.head_dim, "attn_group": group} | shape | overrides))


BATCH_ROWS = (16, 32, 64)                          # the rows a batched kernel is compiled for

def batch_rows(batch: int) -> int:
    """StreamConfig.batch_rows for a decoder of `batch` rows: 0 for one row, else the fewest of
    BATCH_ROWS that hold them (the mma tiles' M side; rows past the batch are masked)."""
    return 0 if batch <= 1 else next(n for n in BATCH_ROWS if n >= batch)


def unsupported(cfg: ModelConfig, dtype) -> str | None:
    """Why the streaming step cannot run this model in `dtype` (a name or torch dtype), or None."""
    if str(dtype).removeprefix("torch.") != "bfloat16":
        return f"it runs bfloat16 models, and this one runs in {str(dtype).removeprefix('torch.')}"
    if cfg.mlp_bias:
        return "it has no MLP bias yet"
    if cfg.head_dim not in (16, 32, 64, 128, 256):
        return f"its attention takes a head_dim that is a power of two from 16 to 256, not {cfg.head_dim}"
    return None


def split_levels(cfg: ModelConfig, config: StreamConfig, max_context: int, ctas: int = 132,
                 rows: int = 1) -> list[int]:
    """The attention split counts a decoder builds a program for: 1, 2, 4, ... up to the count
    max_context needs (attention_splits), and that count. A launch runs the fewest its context
    takes (StreamDecoder.level): shares with no tokens still wait, store and take their ticket, and
    a short context over the longest's count paid for them (H200, context 96: Llama-3.2-1B 0.960
    ms a step with 2 shares a KV head, 0.999 with 15; SmolLM2-135M 0.554 with 2, 0.702 with 32)."""
    top = attention_splits(cfg, config, max_context, ctas, rows)
    return sorted({1 << k for k in range(top.bit_length()) if 1 << k < top} | {top})


def attention_splits(cfg: ModelConfig, config: StreamConfig, context: int, ctas: int = 132, rows: int = 1) -> int:
    """Shares of the context per KV head (of each of `rows` rows): at most one attention node per
    SM (a CTA running two shares finishes last and holds up the layer), at batch 1 with one SM a
    KV head to spare (its figures were measured this way), and a batch's on every SM (H200,
    Llama-3.2-1B at 512 tokens, batch 8: 2 shares, 128 nodes, 1.678 -> 1.588 ms a step), each
    share at least a ring chunk of tokens."""
    heads = rows * cfg.num_kv_heads
    fit = (ctas - heads) // heads if rows == 1 else ctas // heads
    return max(1, min(fit, -(-context // max(1, config.kv_tokens))))


class StreamDecoder:
    MAX_STEPS = 256                               # the most steps one launch (generate) runs

    def __init__(self, cfg: ModelConfig, weights: ModelWeights, device="cpu", max_context: int = 1024,
                 block_size: int = 16, splits: int | None = None, config: StreamConfig | None = None,
                 kv=None, pools=None, batch: int = 1, prebuilt=None, tp=None, defer: bool = False) -> None:
        """kv: a paged bf16 KV cache to share ([layers, 2, blocks, block_size, kv heads, head_dim],
        the engine's KVCacheLayout); default: one of its own, blocks enough for max_context.
        pools: pack_pools(weights, device)'s Packed, when the caller packed them (default: packed here).
        splits: attention shares per KV head, one program; default: one program per split_levels
        level, each launch running the one its context needs.
        batch: rows a step decodes, each at its own position over its own block table (the CPU
        reference and the streaming kernel, the kernel's GEMVs then on tensor cores).
        prebuilt: where the kernel comes from on a GPU (stream_shipped.prebuilt_folder): "auto" (the shipped kernels
        where they hold this shape), a folder of prebuilt kernels (runtime/stream/prebuilt.py),
        launched with no compiler, or None / "off" (compiled). `compiles` says why it is compiled
        when "auto" found none.
        tp: tensor parallelism: a stream_tp.GroupRank (a process a rank; on GPUs written, not yet run), or on
        the CPU this rank's side of an exchange (reference.Exchange(world).rank(r), each rank's
        decoder in its own thread). `cfg` is then the
        whole model and `weights` the rank's share (tp.shard.shard_weights: its heads and MLP columns
        and its vocabulary shard of the embedding and lm_head); all-reduce nodes sum the ranks' embedding
        rows and o_proj and down_proj partial sums into the residual, the same bits on every rank, and
        gather the lm_head shards' amax pairs, so every rank samples the same tokens. The KV cache holds
        the rank's KV heads; logits() and step() gather the vocabulary (a collective: every rank calls
        them). One row.
        defer: build only the smallest split level's program now (on a GPU its executor, placed and
        hazard-checked), and each other one when build_deferred() is called (a server's idle time:
        its start is seconds shorter) or when a launch first needs it."""
        import torch
        if cfg.mlp_bias:
            raise NotImplementedError("the streaming step has no MLP bias yet (mlp_bias models run per op)")
        if max_context < 1 or block_size < 1 or batch < 1 or (splits is not None and splits < 1):
            raise ValueError("max_context, block_size, batch and splits must be positive")
        self.tp, self.world = tp, 1 if tp is None else tp.world
        if tp is not None:
            cfg = rank_config(cfg, self.world, weights)
            if batch != 1:
                raise ValueError(f"batch {batch}: a tensor-parallel decoder decodes one row (batches run per op)")
            if not hasattr(tp, "group" if torch.device(device).type != "cpu" else "gather"):
                raise ValueError("tp: a stream_tp.GroupRank (the ranks' torch.distributed group, a process a rank), "
                                 "or on the CPU the rank's side of a reference.Exchange (ranks in threads)")
        self.cfg, self.device, self.batch = cfg, torch.device(device), batch
        if batch > BATCH_ROWS[-1]:
            raise ValueError(f"batch {batch}: a decoder runs at most {BATCH_ROWS[-1]} rows")
        self.config = config or stream_config(cfg, block_size, batch_rows=batch_rows(batch),
                                              tensor_parallel=tp is not None)
        if self.device.type == "cuda" and batch > max(1, self.config.batch_rows):
            raise ValueError(f"batch {batch}: the kernel's StreamConfig.batch_rows is {self.config.batch_rows}; "
                             f"use {batch_rows(batch)} (or leave config out)")
        self.levels = [splits] if splits else split_levels(cfg, self.config, max_context, rows=batch)
        self.splits = self.levels[-1]
        self.block_size, self.max_context = block_size, max_context
        self.step_words = 3 + cdiv(max_context, block_size)      # a row's: pos, n_ctx, write, the block table
        hd, kvh = cfg.head_dim, cfg.num_kv_heads
        if kv is None:
            kv = torch.zeros(cfg.num_layers, 2, cdiv(max_context, block_size), block_size, kvh, hd,
                             dtype=torch.bfloat16, device=self.device)
        elif tuple(kv.shape[:2]) != (cfg.num_layers, 2) or tuple(kv.shape[3:]) != (block_size, kvh, hd):
            raise ValueError(f"the KV cache {tuple(kv.shape)} is not [{cfg.num_layers}, 2, blocks, {block_size}, "
                             f"{kvh}, {hd}]")
        self.kv, self.blocks = kv, kv.shape[2]
        packed = pools or pack_pools(weights, self.device)
        embed = weights.embed.detach().to(device=self.device, dtype=torch.bfloat16)
        rope = cos_sin_table(cfg.rope, hd, max_context, self.device)
        # the level built first (and hazard-checked on a GPU): the largest, or with defer the smallest,
        # the one a short first request runs; the others defer until build_deferred or a launch
        head = self.levels[0] if defer and tp is None else self.splits
        self._deferred = [s for s in self.levels if s != head] if defer and tp is None else []
        self._record_level = lambda s: record_step(self, weights, packed, embed, rope, s)
        self.programs = {s: self._record_level(s) for s in self.levels if s not in self._deferred}
        self.program = self.programs[head]        # every level declares the same regions
        self.regions = self.program.regions
        self.arena = self.program.arena(self.device)
        self.ints = self.program.int_arena(self.device)
        self.executors = {}
        self.compiles = ""
        if self.device.type == "cuda":
            from warploop.runtime.stream.executor import StreamExecutor
            major, minor = torch.cuda.get_device_capability(self.device)
            auto = prebuilt == "auto"
            prebuilt, self.compiles = prebuilt_folder(prebuilt, self.config, major * 10 + minor, block_size)
            # placed programs are cached (not a traced one: its scripts read the build's instructions)
            cache = None if self.config.trace else os.path.join(settings.get().cache_dir, "stream-builds")
            group = None if tp is None else tp.group
            first, prebuilt, why = first_executor(
                lambda folder: StreamExecutor(self.program, self.device, prebuilt=folder, build_cache=cache,
                                              tp_group=group), prebuilt, auto)
            self.compiles = why or self.compiles
            # the levels are one recording with other share counts: the first is hazard-checked
            # here, every level in the tests (tests/test_stream_step.py)
            self._executor_for = lambda p: StreamExecutor(p, self.device, share=first, check=False,
                                                          prebuilt=prebuilt, build_cache=cache, tp_group=group)
            self.executors = {s: first if s == head else self._executor_for(p) for s, p in self.programs.items()}
            self.arena, self.ints = first.arena, first.ints
        self.executor = self.executors.get(head)     # the launch in flight's (set by each launch)

    def build_deferred(self) -> bool:
        """One half of the smallest split level still deferred (defer=True): its program's recording,
        or, recorded, the rest (on a GPU its executor: placement, the upload); whether more remain.
        Halves, so a request that arrives meanwhile waits for less (a server's engine calls this
        between requests, in its own thread)."""
        if self._deferred:
            level = self._deferred[0]
            if level not in self.programs:
                self.programs[level] = self._record_level(level)
            else:
                self._build_level(level)
        return bool(self._deferred)

    def _build_level(self, level: int) -> None:
        if level in self._deferred:
            if level not in self.programs:
                self.programs[level] = self._record_level(level)
            if self.device.type == "cuda":
                self.executors[level] = self._executor_for(self.programs[level])
            self._deferred.remove(level)

    def level(self, n_ctx: int) -> int:
        """The split level a launch whose last step attends over n_ctx tokens runs: the fewest
        shares that still give each share at most a share's worth (attention_splits)."""
        want = attention_splits(self.cfg, self.config, n_ctx, rows=self.batch)
        return next((s for s in self.levels if s >= want), self.levels[-1])

    def view(self, name: str):
        reg: Region = self.regions[name]
        return self.arena[reg.offset:reg.offset + reg.size]

    def logits(self):
        """The latest step's float32 logits, [batch, vocab] (a view, valid until the next step; with
        tensor parallelism a copy, every rank's shard gathered: every rank calls it)."""
        if self.tp is not None:
            import torch
            return torch.cat(self.tp.gather(self.view("logits")))[:self.cfg.vocab_size][None]
        return self.view("logits").view(self.batch, self.cfg.vocab_size)

    def step(self, token: int, pos: int, table: list[int] | None = None, sampling: tuple | None = None):
        """Run one token at `pos` (its KV goes to the cache; the context is tokens 0..pos) through
        blocks `table` (default 0, 1, 2, ...); returns the float32 logits (a view, valid until the
        next step; gathered with tensor parallelism, as logits()). The kernel's pick is tokens(1)[0]:
        the argmax, or with sampling = (temperature, seed) a draw from softmax(logits / temperature)
        by Gumbel-max (philox.py: a seed and position give one token). Batch 1; step_rows for a batch."""
        self._check_one()
        self._run([token], [pos], 1, [table], sampling=sampling)
        return self.view("logits") if self.tp is None else self.logits()[0]

    def step_rows(self, tokens: list[int], positions: list[int], tables: list[list[int]]):
        """One step of every row: row b's token at positions[b] through blocks tables[b] (each row
        its own blocks); returns the logits, [batch, vocab]."""
        self._run(tokens, positions, 1, tables)
        return self.logits()

    def generate(self, token: int, pos: int, steps: int, table: list[int] | None = None,
                 sampling: tuple | None = None) -> list[int]:
        """Decoding in one launch: `token` at `pos`, then each step's pick (greedy, or sampling as in
        step) at the next position, `steps` steps; returns the picked tokens. `table` must cover
        pos + steps - 1. The logits view holds the last step's. Batch 1; generate_rows for a batch."""
        self._check_one()
        self._run([token], [pos], steps, [table], sampling=sampling)
        return self.tokens(steps)

    def generate_rows(self, tokens: list[int], positions: list[int], steps: int,
                      tables: list[list[int]]) -> list[list[int]]:
        """generate for every row at once, each from its own position over its own blocks;
        returns each row's picked tokens."""
        self._run(tokens, positions, steps, tables)
        return self.row_tokens(steps)

    def launch(self, token: int, pos: int, steps: int, table: list[int] | None = None,
               sampling: tuple | None = None) -> None:
        """generate's launch, without the wait (on the CPU it runs here): wait(), then tokens()."""
        self._check_one()
        self._run([token], [pos], steps, [table], wait=False, sampling=sampling)

    def launch_rows(self, tokens: list[int], positions: list[int], steps: int, tables: list[list[int]],
                    sampling: tuple | None = None) -> None:
        """generate_rows's launch, without the wait (on the CPU it runs here): wait(), then row_tokens().
        1 to `batch` rows; the rest idle. sampling: as in step, for a decoder of one row."""
        self._run(tokens, positions, steps, tables, wait=False, sampling=sampling)

    def wait(self, timeout: float = 60.0) -> None:
        if self.executor is not None:
            self.executor.wait(timeout)

    def done(self) -> bool:
        """Whether the launched steps have finished (never blocks)."""
        return self.executor is None or self.executor.idle()

    def tokens(self, steps: int) -> list[int]:
        """The tokens the latest launch picked, one a step (row 0's)."""
        return self.row_tokens(steps)[0]

    def row_tokens(self, steps: int) -> list[list[int]]:
        """Each row's tokens of the latest launch, one a step."""
        r = self.program.int_regions["tokens"]
        return self.ints[r.offset:r.offset + r.size].view(self.batch, self.MAX_STEPS)[:, :steps].tolist()

    def _check_one(self) -> None:
        if self.batch != 1:
            raise ValueError(f"this decoder runs batches of {self.batch}: use step_rows / generate_rows")

    def _run(self, tokens: list[int], positions: list[int], steps: int, tables: list, wait: bool = True,
             sampling: tuple | None = None) -> None:
        import numpy as np
        import torch

        from warploop.runtime.stream.reference import reference
        if not 1 <= steps <= self.MAX_STEPS:
            raise ValueError(f"steps must be 1 to {self.MAX_STEPS}, not {steps}")
        if "samp" in self.program.int_regions:        # temperature 0: the argmax
            temperature, seed = sampling if sampling is not None else (0.0, 0)
            if not temperature >= 0 or temperature == float("inf"):
                raise ValueError(f"sampling: the temperature must be finite and >= 0, not {temperature}")
            seed &= (1 << 64) - 1
            words = [int(np.float32(temperature).view(np.int32)), *(int(np.uint32(v).view(np.int32)) for v in
                                                                     (seed & 0xFFFFFFFF, seed >> 32)), positions[0] + 1]
            r = self.program.int_regions["samp"]
            self.ints[r.offset:r.offset + len(words)] = torch.tensor(words, dtype=torch.int32, device=self.ints.device)
        elif sampling is not None:
            raise ValueError("sampling on the kernel takes a decoder of one row (batches sample on the host)")
        if not 1 <= len(tokens) == len(positions) == len(tables) <= self.batch:
            raise ValueError(f"a step takes 1 to {self.batch} row(s): tokens, positions and tables, one each; got "
                             f"{len(tokens)}, {len(positions)}, {len(tables)}")
        bs, words, longest = self.block_size, [], 0
        for b, (token, pos, table) in enumerate(zip(tokens, positions, tables, strict=True)):
            at = f"row {b}: " if self.batch > 1 else ""
            last = pos + steps - 1
            if not 0 <= pos or last >= self.max_context:
                raise ValueError(f"{at}positions {pos} to {last} are outside the decoder's max_context "
                                 f"{self.max_context}")
            if not 0 <= token < self.cfg.vocab_size:
                raise ValueError(f"{at}token {token} is outside the vocabulary of {self.cfg.vocab_size}")
            table = list(range(cdiv(last + 1, bs))) if table is None else list(table)
            if not cdiv(last + 1, bs) <= len(table) <= cdiv(self.max_context, bs) or \
                    not all(0 <= blk < self.blocks for blk in table):
                raise ValueError(f"{at}the block table must cover {cdiv(last + 1, bs)} blocks (at most "
                                 f"{cdiv(self.max_context, bs)}) of the cache's {self.blocks}")
            # position, context length, write the new k and v, the block table (padded to the row's words)
            words += [pos, pos + 1, 0] + table + [0] * (self.step_words - 3 - len(table))
            longest = max(longest, last + 1)
        # rows past the live ones are idle: no context at the launch's first step and no KV write
        # (their attention only waits and signals there; later steps attend to a few rows of block 0,
        # writing nothing), their outputs unread
        words += ([0, 0, -1] + [0] * (self.step_words - 3)) * (self.batch - len(tokens))
        tokens = list(tokens) + [0] * (self.batch - len(tokens))
        for name, vals in (("step", words), ("token", list(tokens))):
            r = self.program.int_regions[name]
            self.ints[r.offset:r.offset + len(vals)] = torch.tensor(vals, dtype=torch.int32, device=self.ints.device)
        level = self.level(longest)
        self._build_level(level)
        if self.executors:
            self.executor = self.executors[level]
            self.executor.launch(steps)
            if wait:
                self.executor.wait()
        else:
            self.arena = reference(self.programs[level], self.arena, self.ints, self.kv, steps=steps, exchange=self.tp)
