"""The generated resident kernel itself: it compiles for GPU targets without a GPU, and its loop
(front + worker in one program) runs in the interpreter, agreeing with the CPU executor."""

import pytest
import torch
import triton
import triton.language as tl
from example_loader import load_example
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import warploop
from warploop.runtime import codegen
from warploop.runtime.tasks import lookup


@warploop.task(signature={"x": "*fp32"}, heavy=True)
@triton.jit
def heavy_mark(x):
    """A task marked heavy: its presence makes the worker read instruction words after each body."""
    tl.store(x, 1.0)


def test_generated_source_dispatches_every_task():
    tr = load_example("tree_reduce")
    tasks = [lookup(t) for t in tr.TASKS]
    src = codegen.generate(tasks)
    for t in tasks:
        assert f"elif op == {t.opcode}:  # {t.name}" in src
    assert src == codegen.generate(list(reversed(tasks)))        # same set, same text, same cache entry
    assert "W.arg(a, 1, pmask, params).to(tl.pointer_type(tl.float32))" in src
    assert "W.arg(a, 2, pmask, params).to(tl.int32)" in src


@pytest.mark.parametrize("target, backend", [(GPUTarget("cuda", 90, 32), "cuda"),
                                             (GPUTarget("hip", "gfx942", 64), "hip")])
def test_resident_kernel_compiles_for_gpu_targets(target, backend):
    mg = load_example("mlp_graph")
    module = codegen.build([lookup(t) for t in mg.TASKS])
    src = ASTSource(fn=module.resident, signature={"arena": "*i32"},
                    constexprs={"INLINE": False, "TRACE": backend == "cuda", "BACKEND": backend})
    kernel = triton.compile(src, target=target, options={"num_warps": 4})
    if backend == "cuda":
        ptx = kernel.asm["ptx"]
        assert "ld.acquire.gpu.global.b64" in ptx        # counter polls without atomics
        assert "%globaltimer" in ptx                     # trace clock
        assert "atom.global.sys.release" in ptx          # completions to host memory
    else:
        assert kernel.asm["hsaco"]


def test_mlp_bench_tiles_compile_to_wide_loads_and_one_poller():
    """The MLP stack's tasks for cuda:90: 16-byte weight loads (the ':16' hints reach the body),
    and counter waits polled by one thread that the others meet at a barrier."""
    from warploop.bench.runtime_mlp_tasks import mlp_down_w as mlp_down
    from warploop.bench.runtime_mlp_tasks import mlp_up_w as mlp_up
    module = codegen.build([lookup(mlp_up), lookup(mlp_down)])
    assert "tl.multiple_of(W.arg(a, 0, pmask, params).to(tl.pointer_type(tl.bfloat16)), 16)" in codegen.generate(
        [lookup(mlp_up), lookup(mlp_down)])
    src = ASTSource(fn=module.resident, signature={"arena": "*i32"},
                    constexprs={"INLINE": False, "TRACE": False, "BACKEND": "cuda"})
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
    assert "ld.global.L1::evict_first.L2::cache_hint.v4.b32" in ptx
    assert "ld.global.L1::evict_first.L2::cache_hint.b16" not in ptx
    assert "@%pw bra WL_MEET" in ptx and "barrier.sync 0" in ptx


def test_heavy_task_sets_read_instruction_words_after_each_body():
    """A set with a heavy task: WORDS_AFTER in the source, and on sm_90 the next instruction's line
    prefetched into L1 (no registers held across the body); a light set keeps its words in registers."""
    mg = load_example("mlp_graph")
    light = [lookup(t) for t in mg.TASKS]
    heavy = light + [lookup(heavy_mark)]
    assert "WORDS_AFTER = tl.constexpr(0)" in codegen.generate(light)
    assert "WORDS_AFTER = tl.constexpr(1)" in codegen.generate(heavy)
    ptx = {}
    for name, tasks in (("light", light), ("heavy", heavy)):
        src = ASTSource(fn=codegen.build(tasks).resident, signature={"arena": "*i32"},
                        constexprs={"INLINE": False, "TRACE": False, "BACKEND": "cuda"})
        ptx[name] = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
    assert "prefetch.global.L1" in ptx["heavy"]
    assert "prefetch.global.L1" not in ptx["light"]


def test_megakernel_tasks_are_heavy():
    from warploop.llm.mk.layout import Plan
    from warploop.llm.mk.tasks import tasks_for
    tasks = [lookup(t) for t in tasks_for(Plan("bf16", 4, 2, 16, 16)).all]
    assert "WORDS_AFTER = tl.constexpr(1)" in codegen.generate(tasks)


@pytest.mark.parametrize("heavy", [False, True], ids=["words-ahead", "words-after"])
def test_resident_loop_in_the_interpreter_matches_the_executor(heavy):
    tr, mg = load_example("tree_reduce"), load_example("mlp_graph")
    x = torch.randn(1500)
    dim, hidden = 24, 40
    w1, w2 = torch.randn(hidden, dim), torch.randn(dim, hidden)
    xin = torch.randn(dim)
    results = {}
    for mode in ("executor", "inline"):
        with warploop.Runtime(device="cpu", tasks=tr.TASKS + mg.TASKS + ([heavy_mark] if heavy else []),
                              workers=1) as rt:
            tree = torch.zeros(tr.tree_size(x.numel()))
            h, y = torch.empty(hidden), torch.empty(dim)
            g = mg.build(rt, w1, w2, h, y)
            future = rt.submit(tr.reduce, x, tree, 0, 0, x.numel())
            run = g.launch(repeat=2, x=xin)
            if mode == "inline":
                rt._backend.run_resident_inline()
                assert future.done() and run.done()
            future.result(timeout=60)
            run.result(timeout=60)
            status = rt.status()
            assert status.issued == status.completed > 5 and status.graph_runs == 2
            results[mode] = (tree.clone(), y.clone())
    assert torch.equal(results["executor"][0], results["inline"][0])
    assert torch.equal(results["executor"][1], results["inline"][1])
    assert abs(float(results["inline"][0][0]) - float(x.double().sum())) < 1e-3
