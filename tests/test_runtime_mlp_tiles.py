"""The MLP bench's unrolled GEMV tiles: right on the CPU (Triton interpreter, through the runtime's
CPU executor), and compiled for cuda:90 so that a whole tile's weights are loaded before the wait."""
import re

import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import warploop
from warploop.bench.runtime_mlp_tasks import MLP_SCHEDULES, MLP_SIG, mlp_tile
from warploop.runtime import codegen
from warploop.runtime.tasks import lookup

PAIRS = [(up, down) for up, down, _, _ in MLP_SCHEDULES.values()]


def test_unrolled_tiles_match_fp32_and_the_chunked_tiles_on_the_cpu():
    g = torch.Generator().manual_seed(1234)
    w1, x = torch.randn(32, 2048, generator=g).bfloat16(), torch.randn(2048, generator=g).bfloat16()
    w2, h = torch.randn(8, 8192, generator=g).bfloat16(), torch.randn(8192, generator=g).bfloat16()
    ref_up = torch.nn.functional.silu(w1.float() @ x.float())
    ref_down = w2.float() @ h.float()
    outs = []
    with warploop.Runtime(device="cpu", tasks=[t for pair in PAIRS for t in pair], workers=2) as rt:
        for up, down in PAIRS:
            y1 = torch.full((32,), float("nan")).bfloat16()       # poisoned: every row must be written
            y2 = torch.full((8,), float("nan")).bfloat16()
            graph = rt.graph()
            bn_up, bn_down = lookup(up).constexprs["BN"], lookup(down).constexprs["BN"]
            for row0 in range(0, 32, bn_up):
                graph.add(up, w1, x, y1, 2048, row0)
            for row0 in range(0, 8, bn_down):
                graph.add(down, w2, h, y2, 8192, row0)
            graph.run(timeout=120)
            outs.append((y1.float(), y2.float()))
    for y1, y2 in outs:
        assert float((y1 - ref_up).norm() / ref_up.norm()) < 1e-2
        assert float((y2 - ref_down).norm() / ref_down.norm()) < 1e-2
    # One reduction per tile instead of one per chunk changes only the fp32 summation order.
    for y1, y2 in outs[1:]:
        assert torch.allclose(y1, outs[0][0], rtol=2e-2, atol=2e-2)
        assert torch.allclose(y2, outs[0][1], rtol=2e-2, atol=2e-2)


# The bench's tile body with the whole 64 KB tile issued before the wait (AHEAD 4 of 16 KB chunks).
UP_A4 = {"BN": 16, "BK": 512, "K": 2048, "AHEAD": 4}
DOWN_A4 = {"BN": 4, "BK": 2048, "K": 8192, "AHEAD": 4}


@warploop.task(signature=MLP_SIG, constexprs=UP_A4, waits=True, cost=1.0)
@triton.jit
def mlp_up_a4(ctx, w, x, y, k, row0, BN: tl.constexpr, BK: tl.constexpr, K: tl.constexpr, AHEAD: tl.constexpr,
              BACKEND: tl.constexpr):
    mlp_tile(ctx, w, x, y, k, row0, BN, BK, K, AHEAD, True, BACKEND)


@warploop.task(signature=MLP_SIG, constexprs=DOWN_A4, waits=True, cost=1.0)
@triton.jit
def mlp_down_a4(ctx, w, x, y, k, row0, BN: tl.constexpr, BK: tl.constexpr, K: tl.constexpr, AHEAD: tl.constexpr,
                BACKEND: tl.constexpr):
    mlp_tile(ctx, w, x, y, k, row0, BN, BK, K, AHEAD, False, BACKEND)


def test_ahead4_tile_loads_all_its_weights_before_the_wait():
    """cuda:90 PTX: 32 sixteen-byte weight loads (a 16x2048 bf16 tile over 128 threads) directly
    before the counter wait, so a worker streams its next tile while it waits at a GEMV boundary;
    and x is read in the tile's layout, with no barrier between chunks."""
    module = codegen.build([lookup(mlp_up_a4), lookup(mlp_down_a4)])
    src = ASTSource(fn=module.resident, signature={"arena": "*i32"},
                    constexprs={"INLINE": False, "TRACE": False, "BACKEND": "cuda"})
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    ptx, ttgir = kernel.asm["ptx"], kernel.asm["ttgir"]
    # x arrives in the tile's own layout: no per-chunk conversion through shared memory.
    assert not re.search(r"convert_layout .*tensor<(512|2048)xbf16", ttgir)
    marks = "".join("L" if "ld.global.L1::evict_first.L2::cache_hint.v4.b32" in line else "W"
                    for line in ptx.splitlines()
                    if "ld.global.L1::evict_first.L2::cache_hint.v4.b32" in line or "bra WL_MEET" in line)
    runs = [len(m) for m in re.findall(r"L+(?=W)", marks)]
    assert runs and all(n == 32 for n in runs), marks
    assert "ld.global.L1::evict_first.L2::cache_hint.b16" not in ptx
