"""Parallel merge sort on the resident runtime, with spawn and join.

The root task sorts blocks in parallel, then merges runs of doubling width, one round at a time:

    root:   h = spawn(sort_blocks);  join(h)                 # every block sorted
            while width < n: h = spawn(merge_round, width); join(h); swap buffers

A round task spawns one merge tile per BLOCK outputs and returns; structured completion means
its handle completes only when all of its tiles have, so the root's join waits for the round.
Only the root joins, so two workers suffice on the GPU.

A merge tile places each element by rank: an element of run A at index i lands at i plus the
number of B elements smaller than it (binary search), an element of B at j plus the number of
A elements not larger. Ties keep A first, so the sort is stable.

    python examples/parallel_sort.py            # runs on the GPU if there is one, else the CPU
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

import warploop
from warploop.runtime import device as wl

BLOCK = 128


@warploop.task(signature={"src": "*fp32", "dst": "*fp32", "lo": "i32", "n": "i32"}, constexprs={"BLOCK": BLOCK})
@triton.jit
def sort_block(src, dst, lo, n, BLOCK: tl.constexpr):
    offs = lo + tl.arange(0, BLOCK)
    v = tl.load(src + offs, mask=offs < n, other=float("inf"))
    tl.store(dst + offs, tl.sort(v), mask=offs < n)


@warploop.task(signature={"src": "*fp32", "dst": "*fp32", "n": "i32"}, constexprs={"BLOCK": BLOCK})
@triton.jit
def sort_blocks(ctx, src, dst, n, BLOCK: tl.constexpr):
    for lo in range(0, n, BLOCK):
        wl.spawn(ctx, sort_block, src, dst, lo, n)


@triton.jit
def rank_in(run, length, values, steps, STRICT: tl.constexpr):
    """For each value, how many of the run's first `length` sorted elements are < it (STRICT) or <= it."""
    lo = tl.zeros(values.shape, tl.int32)
    hi = tl.zeros(values.shape, tl.int32) + length
    for _ in range(steps):
        active = lo < hi
        mid = (lo + hi) // 2
        x = tl.load(run + mid, mask=active, other=0.0)
        below = (x < values) if STRICT else (x <= values)
        lo = tl.where(active & below, mid + 1, lo)
        hi = tl.where(active & ~below, mid, hi)
    return lo


@warploop.task(signature={"src": "*fp32", "dst": "*fp32", "a_lo": "i32", "a_n": "i32", "b_n": "i32", "t": "i32",
                          "steps": "i32"}, constexprs={"BLOCK": BLOCK})
@triton.jit
def merge_tile(src, dst, a_lo, a_n, b_n, t, steps, BLOCK: tl.constexpr):
    k = t * BLOCK + tl.arange(0, BLOCK)           # index within the concatenated runs A ++ B
    valid = k < a_n + b_n
    v = tl.load(src + a_lo + k, mask=valid, other=0.0)
    in_a = k < a_n
    rank_b = rank_in(src + a_lo + a_n, b_n, v, steps, True)      # B elements < v
    rank_a = rank_in(src + a_lo, a_n, v, steps, False)           # A elements <= v
    out = tl.where(in_a, k + rank_b, (k - a_n) + rank_a)
    tl.store(dst + a_lo + out, v, mask=valid)


@warploop.task(signature={"src": "*fp32", "dst": "*fp32", "n": "i32", "width": "i32"},
               constexprs={"BLOCK": BLOCK})
@triton.jit
def merge_round(ctx, src, dst, n, width, BLOCK: tl.constexpr):
    steps = 1                       # binary-search steps for runs of up to `width` elements
    while (1 << (steps - 1)) <= width:
        steps += 1
    for a_lo in range(0, n, 2 * width):
        a_n = tl.minimum(width, n - a_lo)
        b_n = tl.maximum(0, tl.minimum(width, n - a_lo - width))
        for t in range(0, tl.cdiv(a_n + b_n, BLOCK)):
            wl.spawn(ctx, merge_tile, src, dst, a_lo, a_n, b_n, t, steps)


@warploop.task(signature={"data": "*fp32", "tmp": "*fp32", "n": "i32"}, constexprs={"BLOCK": BLOCK})
@triton.jit
def parallel_sort(ctx, data, tmp, n, BLOCK: tl.constexpr):
    wl.join(ctx, wl.spawn(ctx, sort_blocks, data, tmp, n))
    src = tmp
    dst = data
    width = BLOCK
    rounds = 0
    while width < n:
        wl.join(ctx, wl.spawn(ctx, merge_round, src, dst, n, width))
        src, dst = dst, src
        width *= 2
        rounds += 1
    wl.set_result(ctx, rounds % 2)     # 0: sorted data is in tmp, 1: in data


TASKS = [sort_block, sort_blocks, merge_tile, merge_round, parallel_sort]


def sort(rt: warploop.Runtime, data: torch.Tensor, timeout: float | None = None) -> torch.Tensor:
    """Sort a 1-D fp32 tensor on the runtime; returns the sorted tensor."""
    tmp = torch.empty_like(data)
    where = rt.submit(parallel_sort, data, tmp, data.numel()).result(timeout)
    return data if where == 1 else tmp


def main() -> int:
    with warploop.Runtime(tasks=TASKS) as rt:
        device = "cpu" if rt.backend == "cpu" else "cuda"
        data = torch.randn(1000 if device == "cpu" else 1 << 20, device=device)
        expected = torch.sort(data).values
        out = sort(rt, data.clone())
        ok = torch.equal(out, expected)
        print(f"{rt.backend}: sorted {data.numel()} values on {rt.workers} workers: {'ok' if ok else 'MISMATCH'}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
