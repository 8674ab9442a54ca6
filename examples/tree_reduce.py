"""Tree reduction with continuations: no task ever waits while holding a worker.

    reduce(node, lo, hi):  small range -> tree[node] = sum(x[lo:hi])
                           otherwise   -> h = spawn(split, node, lo, hi)
                                          then(h, combine, node)       # runs once both halves are done
    split(node, lo, hi):   spawn(reduce, left child, lo, mid); spawn(reduce, right child, mid, hi)
    combine(node):         tree[node] = tree[left child] + tree[right child]

`split` returns at once, but its handle completes only when the two reductions it spawned have
completed, continuations included (structured completion), so `combine` sees both halves. The
host's future for the root resolves when tree[0] holds the total.

    python examples/tree_reduce.py
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

import warploop
from warploop.runtime import device as wl

LEAF = 256


@warploop.task(signature={"x": "*fp32", "tree": "*fp32", "node": "i32", "lo": "i32", "hi": "i32"},
               constexprs={"LEAF": LEAF})
@triton.jit
def reduce(ctx, x, tree, node, lo, hi, LEAF: tl.constexpr):
    if hi - lo <= LEAF:
        offs = lo + tl.arange(0, LEAF)
        tl.store(tree + node, tl.sum(tl.load(x + offs, mask=offs < hi, other=0.0)))
    else:
        h = wl.spawn(ctx, split, x, tree, node, lo, hi)
        wl.then(ctx, h, combine, tree, node)


@warploop.task(signature={"x": "*fp32", "tree": "*fp32", "node": "i32", "lo": "i32", "hi": "i32"},
               constexprs={"LEAF": LEAF})
@triton.jit
def split(ctx, x, tree, node, lo, hi, LEAF: tl.constexpr):
    mid = lo + tl.cdiv((hi - lo) // 2, LEAF) * LEAF     # leaves stay aligned to LEAF
    wl.spawn(ctx, reduce, x, tree, 2 * node + 1, lo, mid)
    wl.spawn(ctx, reduce, x, tree, 2 * node + 2, mid, hi)


@warploop.task(signature={"tree": "*fp32", "node": "i32"})
@triton.jit
def combine(tree, node):
    tl.store(tree + node, tl.load(tree + 2 * node + 1) + tl.load(tree + 2 * node + 2))


TASKS = [reduce, split, combine]


def tree_size(n: int) -> int:
    """Nodes a tree over n elements can touch: 2^(depth+1) - 1 for ceil(log2(n / LEAF)) levels."""
    depth = max(0, (max(1, -(-n // LEAF)) - 1).bit_length())
    return 2 ** (depth + 1) - 1


def tree_sum(rt: warploop.Runtime, x: torch.Tensor, timeout: float | None = None) -> float:
    tree = torch.zeros(tree_size(x.numel()), dtype=torch.float32, device=x.device)
    rt.submit(reduce, x, tree, 0, 0, x.numel()).result(timeout)
    return float(tree[0])


def main() -> int:
    with warploop.Runtime(tasks=TASKS) as rt:
        device = "cpu" if rt.backend == "cpu" else "cuda"
        x = torch.randn(5000 if device == "cpu" else 1_000_000, device=device)
        total, expected = tree_sum(rt, x), float(x.double().sum())
        ok = abs(total - expected) <= 1e-4 * max(1.0, float(x.abs().sum()))
        print(f"{rt.backend}: sum of {x.numel()} values = {total:.4f} (float64 reference {expected:.4f}): "
              f"{'ok' if ok else 'MISMATCH'}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
