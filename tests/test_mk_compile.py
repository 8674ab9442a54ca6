"""The decode megakernel compiles for the GPUs with no GPU present (sm_80 and sm_90 PTX, gfx942), and
its step-input layout, its plan and WARPLOOP_MK_PLAN refuse bad values with a message naming the field."""
import json

import pytest

from warploop.llm.mk.layout import Plan, RowSampling, StepInputs


def test_step_inputs_round_trip_and_pad_rows_without_slots():
    s = StepInputs(4, 3, (5, 6), (10, 2), (11, 3), (41, 7), ((2, 0, 1), (7,)))
    words = s.serialize()
    assert len(words) == StepInputs.words(4, 3) and tuple(words[:4]) == (4, 3, 2, 0)
    assert list(words[4 + 12:4 + 16]) == [41, 7, -1, -1]       # padding rows: no KV slot
    # tables come back padded to the width (the device reads only what context_lens covers), and
    # rows given no sampling parameters come back greedy
    assert StepInputs.parse(words) == StepInputs(4, 3, (5, 6), (10, 2), (11, 3), (41, 7), ((2, 0, 1), (7, 0, 0)),
                                                 (RowSampling(),) * 2)


def test_step_inputs_carry_sampling_parameters_and_history_last():
    rows = (RowSampling(0.7, 40, 0.9, 0.05, 1.3, seed=-5, counter=12), RowSampling(seed=2 ** 64 - 1))
    s = StepInputs(4, 3, (5, 6), (10, 2), (11, 3), (41, 7), ((2, 0, 1), (7, 0, 0)), rows, ((3, 5, 9), ()), 8)
    words = s.serialize()
    assert len(words) == StepInputs.words(4, 3, 8) == s.used_words and words[3] == 8
    back = StepInputs.parse(words)
    assert back.sampling[0].seed == 2 ** 64 - 5 and back.sampling[1].seed == 2 ** 64 - 1    # 64-bit words
    assert back.history == ((3, 5, 9), ()) and back.sampling[0].top_k == 40 and back.sampling[0].counter == 12
    assert abs(back.sampling[0].top_p - 0.9) < 1e-7 and abs(back.sampling[0].repetition_penalty - 1.3) < 1e-6
    # no history listed: the block ends before the history region (the copy to the GPU stops there)
    plain = StepInputs(4, 3, (5,), (1,), (2,), (3,), ((1,),), (), (), 8)
    assert plain.used_words == StepInputs.words(4, 3) < len(plain.serialize())


@pytest.mark.parametrize("kwargs, message", [
    (dict(batch=1), "a step of 2 sequences does not fit a graph of batch 1"),
    (dict(width=2), "a block table of 3 blocks exceeds the graph's width 2"),
    (dict(slots=(1,)), "StepInputs.slots has 1 rows, token_ids 2"),
    (dict(sampling=(RowSampling(),)), "StepInputs.sampling has 1 rows, token_ids 2"),
    (dict(history=((1, 2, 3), ()), history_width=2), "a history of 3 tokens exceeds the graph's history width 2"),
])
def test_step_inputs_refuse_what_does_not_fit(kwargs, message):
    base = dict(batch=4, width=3, token_ids=(5, 6), positions=(1, 2), context_lens=(2, 3), slots=(1, 2),
                block_tables=((2, 0, 1), (7,)))
    with pytest.raises(ValueError, match=message):
        StepInputs(**{**base, **kwargs})


def test_row_sampling_refuses_values_out_of_range():
    with pytest.raises(ValueError, match="RowSampling out of range"):
        RowSampling(top_p=0.0)
    with pytest.raises(ValueError, match="RowSampling out of range"):
        RowSampling(temperature=-1.0)


def test_plan_refuses_tiles_tl_dot_cannot_take():
    with pytest.raises(ValueError, match="Plan.bn must be a power of two >= 16"):
        Plan("bf16", 4, 2, 64, 16, bn=8)
    with pytest.raises(ValueError, match="Plan.dtype 'int8'"):
        Plan("int8", 4, 2, 64, 16)


def _compile_resident(target: tuple) -> tuple[str, str]:
    """(status, assembly or reason) of the resident kernel a GPU backend starts for Llama-3.2-1B shapes
    (the default GPU plan's batch-1 kernel: 64 KB GEMV tiles, Plan.one_row) compiled for `target`
    (minutes for each target)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from warploop.llm.mk.plans import kernel_plans
    from warploop.llm.mk.tasks import tasks_for
    from warploop.llm.shapes import LLAMA_3_2_1B
    from warploop.runtime import codegen
    from warploop.runtime.tasks import lookup

    plan = kernel_plans(LLAMA_3_2_1B, "bfloat16", 16, "cuda")[0]
    assert plan.one_row and plan.tile_kb == 64
    module = codegen.build([lookup(t) for t in tasks_for(plan).all])
    backend = "cuda" if target[0] == "cuda" else "hip"
    src = ASTSource(fn=module.resident, signature={"arena": "*i32"},
                    constexprs={"INLINE": False, "TRACE": False, "BACKEND": backend})
    try:
        kernel = triton.compile(src, target=GPUTarget(*target), options={"num_warps": 4})
    except RuntimeError as e:    # no ROCm toolchain in this Triton build
        if backend == "hip" and "ld.lld" in str(e):
            return "skip", f"hip toolchain missing: {e}"
        raise
    return "ok", kernel.asm["ptx"] if backend == "cuda" else kernel.asm["amdgcn"]


@pytest.mark.parametrize("target", [("cuda", 80, 32), ("cuda", 90, 32), ("hip", "gfx942", 64)],
                         ids=["sm_80", "sm_90", "gfx942"])
def test_resident_decode_kernel_compiles_without_a_gpu(target):
    """sm_80 and sm_90 PTX and gfx942 code of the whole decode kernel: one target a test (about two
    minutes each on one core with an empty Triton cache), so the suite's workers share them."""
    pytest.importorskip("triton")
    status, asm = _compile_resident(target)
    if target[0] == "hip":
        if status == "skip":
            pytest.skip(asm)
        assert len(asm) > 0
        return
    assert status == "ok" and f".target sm_{target[1]}" in asm
    assert "ld.global.L1::evict_first" in asm             # weight loads streamed, not cached in L1
    assert "prefetch.global.L1" in asm                    # instruction words read after each body


@pytest.mark.parametrize("target", [("cuda", 90, 32), ("hip", "gfx942", 64)], ids=["sm_90", "gfx942"])
def test_sampling_tasks_compile_without_a_gpu(target):
    """The sampling tile and combine alone (philox, the rank merge, the cumulative sum) in a resident kernel."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from warploop.llm.mk.tasks import tasks_for
    from warploop.runtime import codegen
    from warploop.runtime.tasks import lookup

    tasks = tasks_for(Plan("bf16", 32, 8, 64, 16, splits=4, bn=16, bk=256))
    module = codegen.build([lookup(t) for t in (tasks.sample_tile, tasks.sample_combine)])
    backend = target[0]
    src = ASTSource(fn=module.resident, signature={"arena": "*i32"},
                    constexprs={"INLINE": False, "TRACE": False, "BACKEND": backend})
    try:
        kernel = triton.compile(src, target=GPUTarget(*target), options={"num_warps": 4})
    except RuntimeError as e:    # no ROCm toolchain in this Triton build
        if backend == "hip" and "ld.lld" in str(e):
            pytest.skip(f"hip toolchain missing: {e}")
        raise
    if backend == "cuda":
        ptx = kernel.asm["ptx"]
        assert ".target sm_90" in ptx and "mul.hi.u32" in ptx      # philox's rounds
    else:
        assert "v_mul_hi_u32" in kernel.asm["amdgcn"]


def _gemv_kernel(one_row: int = 0):
    """The Llama-3.2-1B-shaped qkv task alone in a resident kernel (tiles plan), compiled for sm_90."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from warploop.llm.mk.tasks import tasks_for
    from warploop.runtime import codegen
    from warploop.runtime.tasks import lookup

    plan = Plan("bf16", 32, 8, 64, 16, splits=4, bn=16, bk=256, hidden=2048, inter=8192, tile_kb=64,
                one_row=one_row)
    module = codegen.build([lookup(tasks_for(plan).qkv)])
    src = ASTSource(fn=module.resident, signature={"arena": "*i32"},
                    constexprs={"INLINE": False, "TRACE": False, "BACKEND": "cuda"})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})


def test_a_batch_1_kernel_carries_no_batch_path():
    """Plan.one_row=1 (the batch-1 graph's own kernel): the row tile's tl.dot blocks for more rows are
    compiled out, so the task has no tensor-core instruction and no shared memory of its own."""
    pytest.importorskip("triton")
    default, one = _gemv_kernel(), _gemv_kernel(one_row=1)
    assert "mma" in default.asm["ptx"] and "mma" not in one.asm["ptx"]
    assert one.metadata.shared < 1024 < default.metadata.shared, (one.metadata.shared, default.metadata.shared)
    assert Plan("bf16", 32, 8, 64, 16, hidden=2048, inter=8192, tile_kb=64, one_row=1).key.endswith("-1")
    with pytest.raises(ValueError, match="Plan.one_row must be 0 or 1"):
        Plan("bf16", 32, 8, 64, 16, hidden=2048, inter=8192, tile_kb=64, one_row=2)


def test_megakernel_options_from_the_environment_are_checked_by_name(monkeypatch):
    from warploop import config
    from warploop.llm.mk.plans import env_options

    monkeypatch.setenv("WARPLOOP_MK_PLAN", '{"tile_kb": 64, "workers": 263}')
    config.reload()
    assert env_options() == {"tile_kb": 64, "workers": 263}
    monkeypatch.setenv("WARPLOOP_MK_PLAN", '{"tile_kb": 64, "tiles": 3}')
    config.reload()
    with pytest.raises(ValueError, match="WARPLOOP_MK_PLAN: unknown option.s. tiles; use any of"):
        env_options()
    monkeypatch.setenv("WARPLOOP_MK_PLAN", "{tile_kb: 64}")
    with pytest.raises(ValueError, match="WARPLOOP_MK_PLAN='{tile_kb: 64}' is not JSON"):
        config.reload()
    monkeypatch.setenv("WARPLOOP_MK_PLAN", "[64]")
    with pytest.raises(ValueError, match="WARPLOOP_MK_PLAN=.* use a JSON object"):
        config.reload()
    monkeypatch.delenv("WARPLOOP_MK_PLAN")
    config.reload()


# Every WARPLOOP_MK_PLAN key, and where its effect is tested (tests/test_mk_decode.py unless named):
# Plan fields: splits (test_one_split_runs_each_groups_attention_as_one_node), bn and bk (every tiles
# test), rows and tile (at their defaults only: the batch graphs' tl.dot blocks, the 130-token
# contexts over 64-token attention tiles), candidates (tests/test_mk_sample.py), depth
# (test_gemv_tiles_match_per_op_backend, 4 and 8), tile_kb (below and the tiles tests); backend
# options: workers (every backend test), worker_warps (tests/test_runtime_submit.py), max_registers
# (tests/test_runtime_dynamic.py), park_after_us (tests/test_runtime_gpu.py, GPU only), timeout,
# fused_upto, batch1_kernel, graph_rows (their test_mk_decode tests).
MK_PLAN_KEYS = {"splits", "bn", "bk", "rows", "tile", "candidates", "depth", "tile_kb", "workers", "worker_warps",
                "max_registers", "park_after_us", "timeout", "fused_upto", "batch1_kernel", "graph_rows"}


def test_megakernel_plan_keys_are_these_and_removed_ones_are_refused_by_name(monkeypatch):
    """The options measured and removed (issue 31: norm_early, batch_stages, batch_tiles, split_rows),
    the model's own widths (hidden, inter) and the batch-1 kernel's one_row are refused, each by name."""
    from warploop import config
    from warploop.llm.mk.plans import env_options

    monkeypatch.setenv("WARPLOOP_MK_PLAN", json.dumps({key: 1 for key in MK_PLAN_KEYS}))
    config.reload()
    assert set(env_options()) == MK_PLAN_KEYS
    with pytest.raises(ValueError) as refused:
        monkeypatch.setenv("WARPLOOP_MK_PLAN", '{"workers": 3, "nope": 1}')
        config.reload()
        env_options()
    assert str(refused.value).startswith("WARPLOOP_MK_PLAN: unknown option(s) nope; use any of ")
    assert set(str(refused.value).split("use any of ")[1].split(", ")) == MK_PLAN_KEYS
    for key in ("norm_early", "batch_stages", "batch_tiles", "split_rows", "hidden", "inter", "one_row"):
        monkeypatch.setenv("WARPLOOP_MK_PLAN", json.dumps({key: 1, "tile_kb": 64}))
        config.reload()
        with pytest.raises(ValueError, match=f"WARPLOOP_MK_PLAN: unknown option.s. {key}; use any of"):
            env_options()
    monkeypatch.delenv("WARPLOOP_MK_PLAN")
    config.reload()


def test_megakernel_options_are_checked_in_one_place_and_take_the_devices_defaults():
    """MegakernelOptions: the backend's keywords split into its own fields and Plan overrides; an
    unknown name, one_row and a bad graph_rows, fused_upto or batch1_kernel are refused on building
    it, before any kernel or weight is touched; None takes the device's default."""
    from warploop.llm.mk.plans import FUSED_UPTO, GPU_GRAPH_ROWS, PARK_AFTER_US, MegakernelOptions

    options = MegakernelOptions.of({"tile_kb": 64, "workers": 3, "graph_rows": 0, "hidden": 64, "inter": 128})
    assert options.workers == 3 and options.graph_rows == 0 and options.park_after_us == PARK_AFTER_US
    assert options.plan == {"tile_kb": 64, "hidden": 64, "inter": 128}
    assert MegakernelOptions.of(options.keywords()) == options
    with pytest.raises(TypeError, match="no option batch_tiles; use any of .*graph_rows.*tile_kb"):
        MegakernelOptions.of({"batch_tiles": 2})
    with pytest.raises(ValueError, match="one_row is the batch-1 kernel's own plan field: use batch1_kernel"):
        MegakernelOptions(plan={"one_row": 1})
    for bad, match in (({"graph_rows": -1}, "graph_rows=-1"), ({"graph_rows": 1.5}, "graph_rows=1.5"),
                       ({"fused_upto": -1}, "fused_upto=-1"), ({"batch1_kernel": 2}, "batch1_kernel=2")):
        with pytest.raises(ValueError, match=match):
            MegakernelOptions.of(bad)
    gpu, cpu = MegakernelOptions().resolved("cuda"), MegakernelOptions().resolved("cpu")
    assert (gpu.workers, gpu.graph_rows, gpu.fused_upto) == ("fill", GPU_GRAPH_ROWS, FUSED_UPTO)
    assert (cpu.workers, cpu.graph_rows, cpu.fused_upto) == (None, 0, 0)
    assert MegakernelOptions(workers=5, graph_rows=4, fused_upto=0).resolved("cuda").workers == 5


def test_plan_tiles_hold_at_most_eight_chunks_and_refuse_bad_sizes():
    # Llama-3.2-1B widths: 64 KB tiles of 8 chunks (gate_up: 8 gate rows and 8 up rows)
    t = Plan("bf16", 32, 8, 64, 16, hidden=2048, inter=8192, tile_kb=64).tile_constexprs()
    assert t == {"TND": 16, "TKD": 256, "TNS": 8, "TKS": 512, "TNQ": 16, "TKQ": 256, "TNF": 4, "TKF": 1024}
    # SmolLM2's 576: [32, 128] chunks, 5 a row, the last one masked
    t = Plan("bf16", 9, 3, 64, 16, hidden=576, inter=1536, tile_kb=64).tile_constexprs()
    assert (t["TND"], t["TKD"], -(-576 // t["TKD"])) == (32, 128, 5)
    with pytest.raises(ValueError, match="Plan.tile_kb must be a power of two >= 4 with the widths set"):
        Plan("bf16", 4, 2, 64, 16, tile_kb=64)
    with pytest.raises(ValueError, match="Plan.tile_kb"):
        Plan("bf16", 4, 2, 64, 16, hidden=64, inter=96, tile_kb=48)
    # widths without tiles was the chunk stream (removed): the GPU plan's GEMVs are tiles
    with pytest.raises(ValueError, match="got 0 with hidden 64"):
        Plan("bf16", 4, 2, 64, 16, hidden=64, inter=96)


def test_gpu_plan_is_tiles_sized_by_the_layer():
    """On a GPU the default plan is GEMV tiles (depth 8): 64 KB for Llama-1B and Qwen3-0.6B layers
    (16 MB or more of projection weights), 32 KB for SmolLM2-135M's; the CPU plan has none, and
    WARPLOOP_MK_PLAN-style overrides win, but none turns the tiles off."""
    from warploop.llm.mk.plans import layer_bytes, plan_for
    from warploop.llm.shapes import LLAMA_3_2_1B, QWEN3_0_6B, SMOLLM2_135M
    assert layer_bytes(LLAMA_3_2_1B, 2) == 2 * (2048 * (2048 + 2 * 512) + 2048 * 2048 + 3 * 2048 * 8192)
    for cfg, kb in ((LLAMA_3_2_1B, 64), (QWEN3_0_6B, 64), (SMOLLM2_135M, 32)):
        plan = plan_for(cfg, "bfloat16", 16, "cuda")
        assert (plan.tile_kb, plan.depth, plan.hidden) == (kb, 8, cfg.hidden_size)
    assert plan_for(SMOLLM2_135M, "bfloat16", 16, "cpu").tile_kb == 0
    assert plan_for(LLAMA_3_2_1B, "bfloat16", 16, "cuda", tile_kb=32, depth=4).tile_kb == 32
    with pytest.raises(ValueError, match="Plan.tile_kb"):
        plan_for(LLAMA_3_2_1B, "bfloat16", 16, "cuda", tile_kb=0)
