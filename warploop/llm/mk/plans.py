"""Which resident kernels the megakernel backend compiles, with which Plans, and its options.

A Plan (layout.py) is one kernel: the model's shapes and the tile sizes as constexprs. `plan_for`
makes a model's Plan for a device (the CPU's interpreter plan or the GPU's tiles plan, with
overrides); `kernel_plans` decides whether batch 1 gets a kernel of its own (`Plan.one_row`) beside
the batches'. `MegakernelOptions` is the backend's settings as one typed record, checked in one
place: its keywords, WARPLOOP_MK_PLAN (`env_options`) and the scripts' plans all come through it.
No GPU and no Triton compile here: scripts/mk_cache.py uses it to compile on a CPU machine the
kernels a GPU backend will start.
"""
from __future__ import annotations

import dataclasses

from warploop.llm.config import ModelConfig
from warploop.llm.mk.layout import TRITON_DTYPES, Plan

CPU_PLAN = {"splits": 2, "bn": 128, "bk": 256}       # fewer, larger tiles: the interpreter pays per op
# On a GPU every GEMV is cut into tiles of tile_kb KB, one node each, the whole tile in flight at once
# (gemv_tile), with every SM slot a worker. A small model wants smaller tiles at batch 1: cut into 64 KB
# tiles, SmolLM2-135M's layer leaves most workers idle in each stage. Measured on an H100, batch 1
# (BENCHMARKS.md, Decode, "tile_kb by model"): SmolLM2-135M (6.8 MB a layer) 32 KB 742 us a step,
# 16 KB 825, 64 KB 834; Qwen3-0.6B (30 MB) 64 KB 1,325, 32 KB 1,596. (Batch 8 prefers the smaller
# tiles of each pair; batch 1 decides here.)
GPU_PLAN = {"splits": 8, "bn": 16, "bk": 256, "depth": 8}
TILE_KB = ((16 << 20, 64), (0, 32))     # (a layer's weight bytes at least, tile_kb), first match
# Idle time before the resident kernel parks (Runtime): longer than the engine's host work between
# two decode steps, so a decode stream does not relaunch the kernel every step; a prefill's first
# use of a CUDA module (a context-wide synchronisation) waits this long once.
PARK_AFTER_US = 5000.0
# Steps whose longest context (to the end of a decode loop) is at most this many tokens run the
# graph with one attention node per (row, KV head group), one stage a layer; longer ones spread
# each context over Plan.splits nodes (three stages: rope_kv, attn, combine). GPU plans only.
FUSED_UPTO = 128
# On a GPU, decode batches of more sequences than this run per op (through CUDA graphs), not on the
# graph: measured on an H100 the per-op path is faster from 2 rows on (BENCHMARKS.md, Decode, session 18).
GPU_GRAPH_ROWS = 1
# Plan fields an option may set: the tile sizes and the GEMV widths (the model's own by default);
# not the model's shapes, nor one_row (the batch-1 kernel's, set through batch1_kernel).
PLAN_OPTIONS = frozenset(f.name for f in dataclasses.fields(Plan)) - {"dtype", "heads", "kv_heads", "head_dim",
                                                                      "block_size", "one_row"}
ONE_ROW_REFUSED = ("one_row is the batch-1 kernel's own plan field: use batch1_kernel=True/False (in "
                   "WARPLOOP_MK_PLAN: \"batch1_kernel\": 1 or 0) to choose whether batch 1 has a kernel of its own")


@dataclasses.dataclass(frozen=True)
class MegakernelOptions:
    """MegakernelBackend's settings: how its resident kernels run, which decode batches take the
    graph, and `plan`, overrides of the Plan's tile sizes. None: the device's default (`resolved`)."""
    workers: int | str | None = None         # resident workers; None: every SM slot on a GPU ("fill")
    timeout: float = 60.0                    # seconds a graph may run before the runtime calls it hung
    trace: bool = False                      # record the runtime's trace
    worker_warps: int = 4
    park_after_us: float | None = PARK_AFTER_US
    fused_upto: int | None = None            # the fused attention graph up to this context; None: FUSED_UPTO (GPU)
    max_registers: int | None = None
    batch1_kernel: bool | int | None = None  # batch 1 on a kernel of its own; None: where the plan has GEMV tiles
    graph_rows: int | None = None            # the most sequences a step runs on the graph; 0: every batch
    use_cuda_graphs: bool = True             # the per-op path's decode batches replay CUDA graphs
    plan: dict = dataclasses.field(default_factory=dict)    # Plan fields (PLAN_OPTIONS)

    ENV_REFUSED = frozenset({"trace", "use_cuda_graphs", "hidden", "inter"})   # not WARPLOOP_MK_PLAN's

    def __post_init__(self) -> None:
        unknown = sorted(set(self.plan) - PLAN_OPTIONS)
        if "one_row" in unknown:
            raise ValueError(ONE_ROW_REFUSED)
        if unknown:
            raise TypeError(f"the megakernel backend has no option{'s' if len(unknown) > 1 else ''} "
                            f"{', '.join(unknown)}; use any of {', '.join(sorted(self.names()))}")
        if self.graph_rows is not None and (not isinstance(self.graph_rows, int) or self.graph_rows < 0):
            raise ValueError(f"graph_rows={self.graph_rows!r}: use the most sequences a decode step runs on the "
                             f"graph with (>= 1; larger batches run per op, through CUDA graphs on a GPU), 0 for "
                             f"every batch on the graph, or leave it out ({GPU_GRAPH_ROWS} on a GPU, 0 on the CPU)")
        if self.fused_upto is not None and (not isinstance(self.fused_upto, int) or self.fused_upto < 0):
            raise ValueError(f"fused_upto={self.fused_upto!r}: use a number of context tokens >= 0 (0: always "
                             f"split attention over Plan.splits nodes)")
        if self.batch1_kernel is not None and self.batch1_kernel not in (True, False, 0, 1):
            raise ValueError(f"batch1_kernel={self.batch1_kernel!r}: use 1 (batch 1 on a kernel of its own) or 0 "
                             f"(one kernel for every batch)")

    @classmethod
    def names(cls, env: bool = False) -> set[str]:
        """Every option's name (env: those WARPLOOP_MK_PLAN may set)."""
        own = {f.name for f in dataclasses.fields(cls)} - {"plan"}
        return (own | PLAN_OPTIONS) - (cls.ENV_REFUSED if env else set())

    @classmethod
    def of(cls, options: dict) -> MegakernelOptions:
        """From keyword options: the backend's own, the rest Plan fields (an unknown one is refused)."""
        own = {f.name for f in dataclasses.fields(cls)} - {"plan"}
        return cls(**{k: v for k, v in options.items() if k in own},
                   plan={k: v for k, v in options.items() if k not in own})

    def keywords(self) -> dict:
        """The options that differ from the defaults, as keywords (`of` takes them back)."""
        default = MegakernelOptions()
        own = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "plan"}
        return {**{k: v for k, v in own.items() if v != getattr(default, k)}, **self.plan}

    def resolved(self, device_type: str) -> MegakernelOptions:
        """The options with the device's defaults for workers, graph_rows and fused_upto."""
        gpu = device_type == "cuda"
        return dataclasses.replace(
            self, workers="fill" if self.workers is None and gpu else self.workers,
            graph_rows=(GPU_GRAPH_ROWS if gpu else 0) if self.graph_rows is None else self.graph_rows,
            fused_upto=(0 if device_type == "cpu" else FUSED_UPTO) if self.fused_upto is None else self.fused_upto)


BACKEND_OPTIONS = tuple(sorted(MegakernelOptions.names(env=True) - PLAN_OPTIONS))


def env_options() -> dict:
    """WARPLOOP_MK_PLAN's options for the megakernel backend (Plan fields and MegakernelBackend's
    own), checked here by MegakernelOptions. The model's shapes and widths (hidden, inter) are no
    options: plan_for takes them from the model."""
    from warploop import config
    opts = config.get().mk_plan
    known = MegakernelOptions.names(env=True)
    unknown = sorted(set(opts) - known)
    if unknown:
        raise ValueError(f"WARPLOOP_MK_PLAN: unknown option(s) {', '.join(unknown)}; use any of "
                         f"{', '.join(sorted(known))}")
    MegakernelOptions.of(opts)
    return dict(opts)


def plan_for(config: ModelConfig, dtype, block_size: int, device_type: str, **overrides) -> Plan:
    name = TRITON_DTYPES.get(str(dtype).removeprefix("torch."))
    if name is None:
        raise ValueError(f"the megakernel backend runs float32, bfloat16 or float16 weights, not {dtype}")
    # on a GPU the GEMVs run tiles over the model's widths (compile-time)
    widths = {} if device_type == "cpu" else {"hidden": config.hidden_size, "inter": config.intermediate_size,
                                              "tile_kb": default_tile_kb(config, 4 if name == "fp32" else 2)}
    sizes = {**(CPU_PLAN if device_type == "cpu" else GPU_PLAN), **widths, **overrides}
    return Plan(name, config.num_heads, config.num_kv_heads, config.head_dim, block_size, **sizes)


def kernel_plans(config: ModelConfig, dtype, block_size: int, device_type: str,
                 options: MegakernelOptions | None = None) -> tuple[Plan, Plan, bool]:
    """(the batch-1 graph's plan, the other graphs' plan, whether those are two kernels) under
    `options` (its Plan overrides and batch1_kernel). batch1_kernel None: two kernels where the plan
    has GEMV tiles on a GPU. With two, the batch-1 plan is `one_row` (its tiles carry no batch path)."""
    options = options or MegakernelOptions()
    plan = plan_for(config, dtype, block_size, device_type, **options.plan)
    batch1_kernel = options.batch1_kernel
    if batch1_kernel is None:
        batch1_kernel = device_type == "cuda" and bool(plan.tile_kb)
    if not batch1_kernel:
        return plan, plan, False
    if not plan.tile_kb:
        raise ValueError("batch1_kernel: a batch-1 kernel needs GEMV tiles (tile_kb set: the GPU plan); "
                         "this plan has none: set batch1_kernel 0 or tile_kb")
    return plan_for(config, dtype, block_size, device_type, **options.plan, one_row=1), plan, True


def layer_bytes(config: ModelConfig, elem: int) -> int:
    """One decoder layer's projection weights, in bytes (qkv, o, gate, up, down)."""
    q, kv, d, f = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim, config.hidden_size, \
        config.intermediate_size
    return elem * (d * (q + 2 * kv) + q * d + 3 * d * f)


def default_tile_kb(config: ModelConfig, elem: int) -> int:
    """The GPU plan's GEMV tile size for a model: TILE_KB's first row its layer reaches."""
    size = layer_bytes(config, elem)
    return next(kb for least, kb in TILE_KB if size >= least)
