"""Shared memory, registers and spills of the decode megakernel's tasks, one task kind at a time
and all together, for a plan of a model's shapes. A resident kernel holds every task, so its
shared memory and registers are those of its most demanding task; this names that task.

    PYTHONPATH=$PWD python scripts/mk_resources.py --model llama-3.2-1b --plan '{"tile_kb": 64}' [--kinds down gate_up]

The kernels are compiled as the runtime compiles them (Triton's JIT warmup): on the GPU, where
registers and spills come from the loaded binary; without one, for sm_90 through a stand-in
driver (shared memory only). One JSON object per kernel is printed, then the TTGIR's shared-memory buffers of
the largest one (shape and count) when --ttgir is given.
"""
from __future__ import annotations

import argparse
import collections
import json
import re
import time

import torch

from warploop.llm.mk.plans import MegakernelOptions, kernel_plans
from warploop.llm.mk.tasks import tasks_for
from warploop.llm.shapes import CPU_MODELS, GPU_MODELS
from warploop.runtime import codegen
from warploop.runtime.tasks import lookup


def plans_of(cfg, overrides: dict, dtype=torch.bfloat16, block_size: int = 16):
    """([the Plan of each resident kernel a GPU backend starts], worker warps, register cap) for a
    model's shapes and WARPLOOP_MK_PLAN-style overrides: the batch-1 kernel's first, then the batches'
    where they differ (plans.kernel_plans; '{"batch1_kernel": 0}' is one kernel for every batch).
    Other backend-only options such as workers are dropped: they do not change the kernel. With
    graph_rows 1 named (the GPU backend's default: batches run per op) the batches' kernel is left out,
    as such a backend starts none; unnamed, both are compiled (scripts/mk_probe.py runs every batch
    on the graph)."""
    options = MegakernelOptions.of(overrides)
    first, many, two = kernel_plans(cfg, dtype, block_size, "cuda", options)
    return ([first, many] if two and options.graph_rows != 1 else [first]), options.worker_warps, options.max_registers


def plan_of(cfg, overrides: dict, dtype=torch.bfloat16):
    """(Plan, worker warps, register cap): the kernel of the batch-1 graph (plans_of's first)."""
    plans, warps, regs = plans_of(cfg, overrides, dtype)
    return plans[0], warps, regs


class StandInDriver:
    """What Triton's JIT asks of a driver to compile (not launch) for `target`."""

    def __init__(self, target) -> None:
        self.target = target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device=None) -> int:
        return 0

    def get_current_target(self):
        return self.target


def compile_kernel(plan, kinds: list[str] | None, warps: int, trace: bool = False, arch: int = 90,
                   max_registers: int | None = None):
    """The resident kernel of the plan's tasks `kinds` (None: every task), compiled as the runtime
    compiles it (Triton's JIT warmup, into Triton's cache, nothing launched): on this machine's GPU,
    or without one for sm_`arch` through a stand-in driver, so the same source, options and target
    give the key a GPU machine looks up (with WARPLOOP_PORTABLE_CACHE: scripts/mk_cache.py)."""
    from warploop.runtime.gpu import compile_resident
    tasks = tasks_for(plan)
    chosen = tasks.all if kinds is None else [getattr(tasks, k) for k in kinds]
    module = codegen.build([lookup(t) for t in chosen])
    if torch.cuda.is_available():
        return compile_resident(module, torch.device("cuda", 0), "cuda", warps, trace, max_registers)[0]
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver
    saved = driver._active      # noqa: SLF001 (reset_active would look for a real driver)
    driver.set_active(StandInDriver(GPUTarget("cuda", arch, 32)))
    try:
        return compile_resident(module, torch.device("cpu"), "cuda", warps, trace, max_registers)[0]
    finally:
        driver._active = saved  # noqa: SLF001


def report(kernel) -> dict:
    out = {"shared": kernel.metadata.shared}
    if torch.cuda.is_available():       # registers are known once the binary is loaded
        try:
            kernel._init_handles()
            out.update(n_regs=kernel.n_regs, n_spills=kernel.n_spills)
        except Exception as e:  # noqa: BLE001 (a kernel over the shared limit fails to load: reported)
            out["load_error"] = f"{type(e).__name__}: {str(e)[:160]}"
    return out


def buffers(ttgir: str) -> list[tuple[str, int]]:
    return collections.Counter(re.findall(r"memdesc<([0-9x]+[a-z0-9]+)", ttgir)).most_common(12)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama-3.2-1b", choices=list(GPU_MODELS) + list(CPU_MODELS))
    parser.add_argument("--plan", default="{}", help="Plan overrides as JSON, e.g. '{\"tile_kb\": 64}'")
    parser.add_argument("--kinds", nargs="*", default=["qkv", "gate_up", "o_proj", "down", "lm_head", "rope_attn"],
                        help="task kinds compiled one at a time (then all of them together unless --alone)")
    parser.add_argument("--alone", action="store_true", help="skip the kernel of every task together")
    parser.add_argument("--warps", type=int, default=4)
    parser.add_argument("--ttgir", action="store_true", help="also list each kernel's shared-memory buffers")
    args = parser.parse_args()
    cfg = (GPU_MODELS | CPU_MODELS)[args.model][1]
    overrides = json.loads(args.plan)
    overrides.setdefault("worker_warps", args.warps)
    plan, warps, regs = plan_of(cfg, overrides)
    runs = [[k] for k in args.kinds] + ([] if args.alone else [None])
    for kinds in runs:
        t0 = time.perf_counter()
        kernel = compile_kernel(plan, kinds, warps, max_registers=regs)
        row = {"kinds": kinds or "all", **report(kernel), "s": round(time.perf_counter() - t0, 1)}
        if args.ttgir:
            row["buffers"] = buffers(kernel.asm.get("ttgir", ""))
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
