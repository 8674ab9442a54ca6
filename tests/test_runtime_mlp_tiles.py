"""The MLP bench's unrolled GEMV tiles: right on the CPU (Triton interpreter, through the runtime's
CPU executor), and compiled for cuda:90 so that a whole tile's weights are loaded before the wait."""
import re

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import warploop
from warploop.bench.runtime_mlp_tasks import (
    mlp_down,
    mlp_down_a2,
    mlp_down_a4,
    mlp_down_c4,
    mlp_down_c6,
    mlp_down_f,
    mlp_down_g,
    mlp_down_w,
    mlp_up,
    mlp_up_a2,
    mlp_up_a4,
    mlp_up_c4,
    mlp_up_c6,
    mlp_up_f,
    mlp_up_g,
    mlp_up_w,
)
from warploop.runtime import codegen
from warploop.runtime.tasks import lookup

PAIRS = [(mlp_up, mlp_down), (mlp_up_a2, mlp_down_a2), (mlp_up_a4, mlp_down_a4), (mlp_up_w, mlp_down_w),
         (mlp_up_c4, mlp_down_c4), (mlp_up_c6, mlp_down_c6)]


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
                graph.add(up, w1, x, y1, 2048, row0, w1, 0)
            for row0 in range(0, 8, bn_down):
                graph.add(down, w2, h, y2, 8192, row0, w2, 0)
            graph.run(timeout=120)
            outs.append((y1.float(), y2.float()))
    for y1, y2 in outs:
        assert float((y1 - ref_up).norm() / ref_up.norm()) < 1e-2
        assert float((y2 - ref_down).norm() / ref_down.norm()) < 1e-2
    # One reduction per tile instead of one per chunk changes only the fp32 summation order.
    for y1, y2 in outs[1:]:
        assert torch.allclose(y1, outs[0][0], rtol=2e-2, atol=2e-2)
        assert torch.allclose(y2, outs[0][1], rtol=2e-2, atol=2e-2)


def test_flag_tiles_wait_for_this_runs_flags_and_count_runs_on_the_cpu():
    """The per-tile flag variant: each tile waits for the previous GEMV's 256 flags to reach this
    run's number (its own flag + 1), computes the same tile, and stores its flag + 1. The graph
    edge only orders the CPU executor; the flags the test presets stand in for the other tiles."""
    g = torch.Generator().manual_seed(99)
    w1, x = torch.randn(32, 2048, generator=g).bfloat16(), torch.randn(2048, generator=g).bfloat16()
    w2 = torch.randn(8, 8192, generator=g).bfloat16()
    flags = torch.zeros(3, 256, dtype=torch.int32)      # [previous GEMV, up, down] x tiles
    h = torch.zeros(8192).bfloat16()
    h_ref = torch.nn.functional.silu(w1.float() @ x.float())
    with warploop.Runtime(device="cpu", tasks=[mlp_up_f, mlp_down_f], workers=2) as rt:
        graph = rt.graph()
        up = graph.add(mlp_up_f, w1, x, h, 2048, 0, w1, 0, flags[1], 1)
        y = torch.full((8,), float("nan")).bfloat16()
        graph.add(mlp_down_f, w2, h, y, 8192, 0, w2, 0, flags[2], 1, after=[up])
        for run in (1, 2):
            flags[0, :] = run           # the previous GEMV's tiles, done for this run
            flags[1, 1:] = run          # the up tiles this graph does not hold
            y.fill_(float("nan"))
            graph.run(timeout=120)
            assert flags[1, 0] == run and flags[2, 0] == run
            assert not flags[2, 1:].any()
    y_ref = w2[:, :32].float() @ h[:32].float()       # rows of h beyond the one up tile stay zero
    assert float((h[:32].float() - h_ref).norm() / h_ref.norm()) < 1e-2
    assert float((y.float() - y_ref).norm() / y_ref.norm()) < 1e-2


def test_group_counter_tiles_wait_for_their_run_and_count_into_their_group_on_the_cpu():
    """The group-counter variant: 16 counters per GEMV, one per line (32 int32 words apart), 16
    tiles each. Tile 0 of each GEMV reads its run from its own group, waits for the previous GEMV's
    16 groups to reach 16 x run, and adds 1 to its group. The preset words stand in for the tiles
    the graph does not hold."""
    g = torch.Generator().manual_seed(7)
    w1, x = torch.randn(32, 2048, generator=g).bfloat16(), torch.randn(2048, generator=g).bfloat16()
    w2 = torch.randn(8, 8192, generator=g).bfloat16()
    groups = torch.zeros(3, 512, dtype=torch.int32)      # [previous GEMV, up, down] x 16 lines
    line = torch.arange(16) * 32
    h = torch.zeros(8192).bfloat16()
    with warploop.Runtime(device="cpu", tasks=[mlp_up_g, mlp_down_g], workers=2) as rt:
        graph = rt.graph()
        up = graph.add(mlp_up_g, w1, x, h, 2048, 0, w1, 0, groups[1], 1)
        y = torch.full((8,), float("nan")).bfloat16()
        graph.add(mlp_down_g, w2, h, y, 8192, 0, w2, 0, groups[2], 1, after=[up])
        for run in (1, 2):
            groups[0, line] = 16 * run                   # the previous GEMV: every tile done
            groups[1, line[1:]] = 16 * run               # the up tiles of other groups
            groups[1, 0] = 16 * (run - 1) + 15           # ... and the 15 others of group 0
            groups[2, 0] = 16 * (run - 1)                # no other down tile of group 0 yet
            y.fill_(float("nan"))
            graph.run(timeout=120)
            assert groups[1, 0] == 16 * run and groups[2, 0] == 16 * (run - 1) + 1
    y_ref = w2[:, :32].float() @ h[:32].float()
    assert float((y.float() - y_ref).norm() / y_ref.norm()) < 1e-2


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
