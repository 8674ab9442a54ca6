"""The streaming kernel compiles for sm_90 with no GPU, and its PTX holds the ring and the roles:
TMA bulk copies into the ring, mbarrier waits and arrivals, setmaxnreg (a small budget for the
loader, the rest for the consumer), acquire loads for waits and release atomics for publishing; with
attention (kinds.ATTN) compiled in too, and no configuration spills to local memory. (ptxas also spills
registers to the stack frame, which report() gives apart as stack_bytes: 8 to 48 bytes in some batched
and traced configurations under Triton 3.6 and 3.9, not yet zero; a body that spills hundreds, as one
attention variant did, fails the bound of 64.)"""

import pytest

pytest.importorskip("triton.experimental.gluon")
import triton  # noqa: E402

from warploop.runtime.stream.compiled import PTX_MARKERS, StreamConfig, compile_for, report  # noqa: E402
from warploop.runtime.stream.kernel import LOADER_REGS  # noqa: E402

# Stack frames over 64 bytes with a measured reason: Qwen3-0.6B's batch-32 kernel with attention on wgmma
# holds 112 bytes under Triton 3.6.0 (160 before batched kernels dropped the batch-1 GEMV body; 56 under
# 3.9) and measured 2.347 -> 2.069 ms a step against the CUDA cores' attention with none (H200;
# bench/results/stream-attn-wgmma-hd128-h200-20261130.jsonl)
STACK_BYTES = {StreamConfig(head_dim=128, batch_rows=32, block_rows=64, block_k=128, attn_group=2,
                            attn_wgmma=True): 160}


@pytest.mark.parametrize("cfg", [StreamConfig(), StreamConfig(block_rows=16, block_k=128, ring=12, kmax=4096),
                                 StreamConfig(head_dim=64), StreamConfig(head_dim=128, attn_group=2, attn_tile=16),
                                 StreamConfig(head_dim=128, batch_rows=32, block_rows=64, block_k=128, attn_group=2),
                                 StreamConfig(batch_rows=16),
                                 StreamConfig(head_dim=64, batch_rows=32, ring=4, x_stage_kb=64),
                                 StreamConfig(head_dim=64, batch_rows=16, ring=4, x_stage_kb=64),
                                 StreamConfig(head_dim=64, batch_rows=32, block_rows=64, block_k=128),
                                 StreamConfig(head_dim=128, batch_rows=16, block_rows=64, block_k=128, attn_group=2),
                                 StreamConfig(head_dim=64, batch_rows=32, block_rows=64, block_k=128, attn_wgmma=True),
                                 StreamConfig(head_dim=64, batch_rows=32, block_rows=64, block_k=128, attn_wgmma=True,
                                              wgmma_pipe=True),
                                 StreamConfig(head_dim=64, batch_rows=32, block_rows=64, block_k=128, attn_wgmma=True,
                                              gemv_tall=True),
                                 StreamConfig(head_dim=64, batch_rows=16, attn_wgmma=True),
                                 StreamConfig(head_dim=128, batch_rows=32, block_rows=64, block_k=128, attn_group=2,
                                              attn_wgmma=True),
                                 StreamConfig(head_dim=64, trace=True),
                                 StreamConfig(head_dim=64, batch_rows=32, block_rows=64, block_k=128, trace=True)],
                         ids=["default", "narrow", "attention_hd64", "attention_hd128", "batch32_hd128", "batch16",
                              "batch32_four_x_stages", "batch16_eight_x_stages",
                              "batch32_wgmma", "batch16_wgmma_hd128", "batch32_attn_wgmma", "batch32_wgmma_pipe",
                              "batch32_gemv_tall",
                              "batch16_attn_wgmma",
                              "batch32_attn_wgmma_hd128",
                              "attention_hd64_traced", "batch32_wgmma_traced"])
def test_stream_kernel_compiles_for_sm90_with_ring_and_roles(cfg):
    ck = compile_for(cfg, arch=90)
    r = report(ck)
    assert ".target sm_90" in ck.asm["ptx"]
    for marker in PTX_MARKERS:
        assert r["ptx"][marker] > 0, f"{marker} missing from the PTX"
    assert r["roles"]["loader"] == LOADER_REGS.value and r["roles"]["consumer"] > 2 * LOADER_REGS.value
    assert cfg.shared_bytes <= r["shared"] <= 227 * 1024       # an H100's or H200's most for one CTA
    if r["spill_bytes"] is not None:       # cuobjdump ships with Triton's NVIDIA backend
        assert r["spill_bytes"] == 0, f"the kernel spills {r['spill_bytes']} bytes"
        limit = STACK_BYTES.get(cfg, 64)
        assert 0 <= r["stack_bytes"] <= limit, f"the kernel's stack frame holds {r['stack_bytes']} bytes"
    if cfg.head_dim:
        # the loader streams the cached context too: two TMA copies (keys, values) per box of a
        # chunk, beside the four weight pools' one each
        boxes = cfg.kv_tokens // cfg.kv_box(16)
        assert r["ptx"]["cp.async.bulk.tensor"] >= 2 * boxes + 1
    # batch_rows: the batched GEMV's products are tensor-core mmas fed from the ring slot by
    # ldmatrix, and x comes by 16-byte cp.async; neither in the batch-1 kernel. Tiles of 64 rows of
    # bf16 inputs multiply on wgmma instead, both operands from shared memory
    ptx = ck.asm["ptx"]
    mma = bool(cfg.batch_rows)
    wg = mma and cfg.block_rows == 64
    assert ("cp.async.cg.shared.global" in ptx) == mma
    assert ("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in ptx) == (mma and not wg)
    assert (ptx.count("wgmma.mma_async") >= 2 * cfg.block_k // 16) == wg    # a chunk's k-steps, twice for narrow tiles
    assert ("ldmatrix" in ptx) == mma
    # the batch-1 consumer stages x (.cg) and its norm weights 16 bytes a load, not 4, under the Triton
    # the GPU machines and the shipped kernels use (3.6.0; 3.9.0's compile here leaves them 4-byte loads)
    if not mma and triton.__version__.startswith("3.6."):
        norms = ptx.count("ld.global.v4.b32")        # x's .cg loads have the same shape as its norm weights'
        assert norms >= 4 and ptx.count("ld.global.cg.v4.b32") >= norms, "x or the norm weights load 4 bytes at a time"


def test_x_stages_are_what_their_shared_memory_holds_in_a_power_of_two():
    assert StreamConfig().x_stages == 0
    assert StreamConfig(batch_rows=16).x_stages == 4 and StreamConfig(batch_rows=32).x_stages == 2
    assert StreamConfig(batch_rows=32, ring=4, x_stage_kb=64).x_stages == 4
    assert StreamConfig(batch_rows=32, ring=6, x_stage_kb=48).x_stages == 2      # 3 fit: the stages are a power of two
    assert StreamConfig(batch_rows=16, ring=4, x_stage_kb=64).x_stages == 8
    # bf16 stages of 16 rows take half as many float rows of the staged input, beside kmax's
    assert StreamConfig(batch_rows=16, ring=4, x_stage_kb=64, kmax=1024).x_rows == 64
    with pytest.raises(ValueError, match="x_stage_kb must be at least 1"):
        StreamConfig(batch_rows=16, x_stage_kb=0)
    with pytest.raises(ValueError, match="over 220 KB"):
        StreamConfig(batch_rows=32, x_stage_kb=128)              # with the default 8 ring slots


@pytest.mark.parametrize("model", ["llama-3.2-1b", "qwen3-0.6b"])
def test_a_kernel_of_64_rows_compiles_on_wgmma_without_local_memory(model):
    """Batches of 33 to 64 rows (stream_config's BATCH_SHAPES[64]: 64-row wgmma tiles, 4 stages of x in 64
    KB, attention on wgmma) compile for sm_90 with no spills to local memory, within an H200's shared
    memory. Their stack frames (80 and 216 bytes under Triton 3.6.0: two [64, 64] fp32 accumulators a
    narrow tile) are bounded here until a GPU times them against 32 rows (issue 35)."""
    from warploop.llm.shapes import GPU_MODELS
    from warploop.llm.stream_step import stream_config
    config = stream_config(GPU_MODELS[model][1], batch_rows=64)
    ck = compile_for(config, arch=90)
    r = report(ck)
    assert config.shared_bytes <= r["shared"] <= 227 * 1024
    assert ck.asm["ptx"].count("wgmma.mma_async") >= 2 * config.block_k // 16
    if r["spill_bytes"] is not None:
        assert r["spill_bytes"] == 0 and 0 <= r["stack_bytes"] <= 256, r
