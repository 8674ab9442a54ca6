"""The streaming program refuses bad input before anything runs, naming what is wrong: GEMV and
attention nodes that do not fit, configurations, pools, and an executor on a device without the
kernel. The programs are test_stream_program.py's."""
import dataclasses

import pytest
import torch
from test_stream_program import CFG, SHAPES, layer_chain

from warploop.runtime.stream.compiled import StreamConfig
from warploop.runtime.stream.program import StreamProgram


def shifted(region):
    """A region 2 floats past `region`'s start: not 16-byte aligned."""
    return type(region)(region.offset + 2, region.size - 2)


@pytest.mark.parametrize("call, message", [
    (lambda p: p.gemv(5, 0, 16, p.regions["x"], p.regions["y"]), "pool 5 does not exist"),
    (lambda p: p.gemv(0, 40, 16, p.regions["x"], p.regions["y"]), "do not fit pool 0"),
    (lambda p: p.gemv(0, 0, 16, p.regions["y"], p.regions["y"]), "must hold the pool's width"),
    (lambda p: p.gemv(0, 0, 16, shifted(p.regions["x"]), p.regions["y"]), "multiples of 4 floats"),
    (lambda p: p.gemv(0, 0, 16, p.regions["x"], p.regions["y"], norm=shifted(p.regions["x"])), "multiples of 4"),
    (lambda p: p.gemv(0, 0, 16, p.regions["x"], p.regions["x"], epi="gelu"), "epi must be one of"),
    (lambda p: p.gemv(0, 0, 16, p.regions["x"], p.regions["y"], after=[3]), "recorded earlier"),
    (lambda p: p.pool(torch.zeros(4, 12, dtype=torch.bfloat16)), "multiple of 8"),
    (lambda p: p.pool(torch.zeros(4, 512, dtype=torch.bfloat16)), "exceeds StreamConfig.kmax"),
    (lambda p: p.pool(torch.zeros(4, 16)), "bfloat16"),
    (lambda p: p.buffer("x", 4), "declared twice"),
    (lambda p: p.gemv(0, 0, 16, p.regions["x"], p.regions["y"], xbf=True), r"batch-1 kernel .* as fp32"),
    (lambda p: p.cast(p.regions["x"], p.regions["y"], 12), "a multiple of 8"),
    (lambda p: p.cast(p.regions["x"], p.regions["y"], 64), "out of half that"),
])
def test_program_refuses_bad_input_naming_it(call, message):
    p = StreamProgram(CFG)
    p.pool(torch.zeros(48, 64, dtype=torch.bfloat16))
    p.buffer("x", 64)
    p.buffer("y", 16)
    with pytest.raises(ValueError, match=message):
        call(p)


@pytest.mark.parametrize("kw, message", [(dict(block_k=512), "block_k"), (dict(block_rows=8), "block_rows"),
                                         (dict(ring=1), "ring"), (dict(kmax=3000), "kmax"),
                                         (dict(ring=32, block_rows=64), "shared memory"),
                                         (dict(batch_rows=8), "batch_rows must be"),
                                         (dict(batch_rows=128, block_rows=64, block_k=128), "batch_rows must be"),
                                         (dict(batch_rows=64, block_rows=32, block_k=128), "64 for 64 rows"),
                                         (dict(wgmma_pipe=True), "wgmma_pipe needs wgmma tiles"),
                                         (dict(batch_rows=32, block_rows=64, block_k=128, x_stage_kb=16,
                                               wgmma_pipe=True), "4 or more stages"),
                                         (dict(gemv_tall=True), "gemv_tall needs wgmma tiles"),
                                         (dict(batch_rows=32, block_rows=64, block_k=128, gemv_tall=True,
                                               wgmma_pipe=True), "not with wgmma_pipe")])
def test_config_refuses_bad_shapes(kw, message):
    with pytest.raises(ValueError, match=message):
        StreamConfig(**kw)


def test_a_batched_program_refuses_an_fp32_or_normed_gemv():
    p = StreamProgram(dataclasses.replace(CFG, batch_rows=16, block_rows=32, block_k=128))
    p.pool(torch.zeros(48, 64, dtype=torch.bfloat16))
    x, y, g = p.buffer("x", 64), p.buffer("y", 16), p.buffer("g", 64)
    with pytest.raises(ValueError, match="batched kernel .* as CAST nodes bf16 rows"):
        p.gemv(0, 0, 16, x, y)
    with pytest.raises(ValueError, match="an xbf GEMV takes no norm"):
        p.gemv(0, 0, 16, x, y, norm=g, xbf=True)
    p.gemv(0, 0, 16, x, y, xbf=True, after=p.cast(x, x, 64, 1))     # x's bf16 row over its first 32 words
    with pytest.raises(ValueError, match="an obf GEMV"):
        p.gemv(0, 0, 16, x, y, xbf=True, epi="add", obf=True)
    with pytest.raises(ValueError, match=r"must hold 16 rows for each of 2 batch row\(s\) as bf16"):
        p.gemv(0, 0, 16, x, p.buffer("half", 8), xbf=True, batch=2, obf=True)      # 2 rows of 16 bf16: 16 floats
    p.gemv(0, 0, 16, x, p.buffer("bf", 16), xbf=True, batch=2, obf=True)


def test_split_k_refuses_what_the_kernel_cannot_split_and_cast_what_it_cannot_add():
    p = StreamProgram(dataclasses.replace(CFG, batch_rows=32, block_rows=64, block_k=128, kmax=512))
    p.pool(torch.zeros(128, 512, dtype=torch.bfloat16))
    x, parts = p.buffer("x", 2 * 256), p.buffer("parts", 4 * 2 * 128)
    for kw, why in [(dict(epi="add"), "a store GEMV"), (dict(narrow=True), "not narrow"),
                    (dict(splits=5), "at most one"), (dict(splits=3), "make 2 splits of 256"),
                    (dict(out=p.buffer("small", 256)), "must hold 4 splits")]:
        args = dict(batch=2, xbf=True, splits=4) | kw
        out = args.pop("out", parts)
        with pytest.raises(ValueError, match=why):
            p.gemv(0, 0, 128, x, out, **args)
    tiles = p.gemv(0, 0, 128, x, parts, batch=2, xbf=True, splits=4)
    assert [(n.fields["col"], n.fields["k"], n.fields["x"], n.fields["out"]) for n in (p.nodes[t] for t in tiles)] == \
        [(128 * s, 128, x.offset + 64 * s, parts.offset + s * 256 + 64 * t) for s in range(4) for t in range(2)]
    res = p.buffer("res", 256)
    with pytest.raises(ValueError, match="at most 8"):
        p.cast(res, x, 128, 2, part=parts, parts=9)
    with pytest.raises(ValueError, match="part region"):
        p.cast(res, x, 128, 2, parts=4)
    p.cast(res, x, 128, 2, part=parts, parts=4, after=tiles)
    narrow = StreamProgram(dataclasses.replace(CFG, batch_rows=16, block_rows=32, block_k=128, kmax=512))
    narrow.pool(torch.zeros(64, 512, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="64-row tiles"):
        narrow.gemv(0, 0, 32, narrow.buffer("x", 2 * 256), narrow.buffer("o", 2 * 2 * 32), batch=2, xbf=True, splits=2)


def test_attention_refuses_what_does_not_fit_naming_it():
    chain = layer_chain(SHAPES["llama_gqa"], 5)
    p, r = chain.program, chain.regions
    args = (r["qkv"], r["attn"], r["step"], r["cos"], r["sin"])
    kw = dict(heads=4, kv_heads=2, layer=0, scale=0.25)
    with pytest.raises(ValueError, match="layer 7 is outside"):
        p.attention(*args, **(kw | dict(layer=7)))
    with pytest.raises(ValueError, match="do not match the cache's 2 KV heads"):
        p.attention(*args, **(kw | dict(kv_heads=1)))
    with pytest.raises(ValueError, match="part region"):
        p.attention(*args, **kw, splits=3)
    q = StreamProgram(dataclasses.replace(CFG, head_dim=32))
    q.kv_cache(p.kv)
    with pytest.raises(ValueError, match="head_dim=16"):
        q.attention(*args, **kw)
    with pytest.raises(ValueError, match="needs the KV cache"):
        StreamProgram(CFG).attention(*args, **kw)
    with pytest.raises(ValueError, match="contiguous bfloat16"):
        StreamProgram(CFG).kv_cache(torch.zeros(2, 2, 4, 4, 2, 16))


def test_executor_refuses_a_device_without_the_kernel():
    from warploop.runtime.stream.executor import StreamExecutor
    with pytest.raises(RuntimeError, match="Hopper GPU"):
        StreamExecutor(layer_chain().program, device="cpu")
