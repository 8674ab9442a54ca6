"""Which resident kernels the megakernel backend compiles, and with which Plans.

A Plan (layout.py) is one kernel: the model's shapes and the tile sizes as constexprs. `plan_for`
makes a model's Plan for a device (the CPU's interpreter plan or the GPU's tiles plan, with
WARPLOOP_MK_PLAN's overrides); `kernel_plans` decides whether batch 1 gets a kernel of its own
(`Plan.one_row`) beside the batches'; `env_options` reads and checks
WARPLOOP_MK_PLAN. No GPU and no Triton compile here: scripts/mk_cache.py uses it to compile on a
CPU machine the kernels a GPU backend will start.
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
BACKEND_OPTIONS = ("workers", "worker_warps", "max_registers", "park_after_us", "timeout", "fused_upto",
                   "batch1_kernel", "graph_rows")


def env_options() -> dict:
    """WARPLOOP_MK_PLAN's options for the megakernel backend: Plan fields (tile sizes) and
    MegakernelBackend's own (workers, worker_warps, park_after_us), checked by name here. The model's
    shapes and widths (hidden, inter) are no options: plan_for takes them from the model."""
    from warploop import config
    opts = config.get().mk_plan
    known = {f.name for f in dataclasses.fields(Plan)} - {"dtype", "heads", "kv_heads", "head_dim", "block_size",
                                                           "hidden", "inter", "one_row"}
    unknown = sorted(set(opts) - known - set(BACKEND_OPTIONS))
    if unknown:
        raise ValueError(f"WARPLOOP_MK_PLAN: unknown option(s) {', '.join(unknown)}; use any of "
                         f"{', '.join(sorted(known | set(BACKEND_OPTIONS)))}")
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


def kernel_plans(config: ModelConfig, dtype, block_size: int, device_type: str, batch1_kernel: bool | None = None,
                 **overrides) -> tuple[Plan, Plan, bool]:
    """(the batch-1 graph's plan, the other graphs' plan, whether those are two kernels) for Plan
    overrides (WARPLOOP_MK_PLAN's Plan fields). batch1_kernel None: two kernels where the plan has
    GEMV tiles on a GPU. With two, the batch-1 plan is `one_row` (its tiles carry no batch path)."""
    if "one_row" in overrides:
        raise ValueError("one_row is the batch-1 kernel's own plan field: use batch1_kernel=True/False (in "
                         "WARPLOOP_MK_PLAN: \"batch1_kernel\": 1 or 0) to choose whether batch 1 has a kernel "
                         "of its own")
    plan = plan_for(config, dtype, block_size, device_type, **overrides)
    if batch1_kernel is None:
        batch1_kernel = device_type == "cuda" and bool(plan.tile_kb)
    if batch1_kernel not in (True, False, 0, 1):
        raise ValueError(f"batch1_kernel={batch1_kernel!r}: use 1 (batch 1 on a kernel of its own) or 0 (one "
                         f"kernel for every batch)")
    if not batch1_kernel:
        return plan, plan, False
    if not plan.tile_kb:
        raise ValueError("batch1_kernel: a batch-1 kernel needs GEMV tiles (tile_kb set: the GPU plan); "
                         "this plan has none: set batch1_kernel 0 or tile_kb")
    return plan_for(config, dtype, block_size, device_type, **overrides, one_row=1), plan, True


def layer_bytes(config: ModelConfig, elem: int) -> int:
    """One decoder layer's projection weights, in bytes (qkv, o, gate, up, down)."""
    q, kv, d, f = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim, config.hidden_size, \
        config.intermediate_size
    return elem * (d * (q + 2 * kv) + q * d + 3 * d * f)


def default_tile_kb(config: ModelConfig, elem: int) -> int:
    """The GPU plan's GEMV tile size for a model: TILE_KB's first row its layer reaches."""
    size = layer_bytes(config, elem)
    return next(kb for least, kb in TILE_KB if size >= least)
