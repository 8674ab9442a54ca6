"""The shipped per-op bundle on a GPU: each wrapper launched from it gives exactly what Triton's JIT
gives from the same source, and `warploop generate` on the per-op backend runs in a process that
cannot import Triton. tests/test_ops_prebuilt.py tests the rest on the CPU."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from warploop.llm import layers, ops_prebuilt, paged_attention, triton_ops

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def both_ways(monkeypatch, run, *args):
    """run(*args) from the bundle (a launch that reaches the JIT fails), then through the JIT: both results."""
    def no_jit(name, *rest):
        raise AssertionError(f"{name} went to Triton's JIT: the bundle has no fitting specialization")

    with monkeypatch.context() as m:
        m.setattr(ops_prebuilt, "jit_launch", no_jit)
        from_bundle = run(*args)
    with ops_prebuilt.jit_only():
        from_jit = run(*args)
    torch.cuda.synchronize()
    return from_bundle, from_jit


def same(a, b, what):
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=0, msg=lambda m: f"{what}: {m}")


def norms(x, res, w):
    return (*triton_ops.rms_norm(x, w, 1e-6), *triton_ops.rms_norm(x, w, 1e-6, res.clone()))


def decode(q, k_cache, v_cache, tables, ctx, ws):
    """The rows with a context: a padding row's output is left unwritten."""
    return [paged_attention.decode_attention(q, k_cache, v_cache, tables, ctx, q.shape[-1] ** -0.5, ws)[:3]]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("d", [64, 128])
def test_wrappers_from_the_bundle_equal_the_jit(dtype, d, monkeypatch):
    dev = torch.device("cuda", torch.cuda.current_device())
    assert ops_prebuilt.shipped(dev.index) is not None, "the shipped bundle did not load here (see the log)"
    assert (paged_attention.PARTITION, paged_attention.PREFILL_BM) == (512, 128), "a test left its tiles behind"
    gen = torch.Generator(device=dev).manual_seed(d)

    def randn(*size, dt=dtype):
        return torch.randn(*size, generator=gen, device=dev).to(dt)

    for cols in (2048, 9000 + 8):             # a row in registers; rms_norm's loop over column blocks
        x, res, w = randn(5, cols), randn(5, cols), randn(cols)
        same(*both_ways(monkeypatch, norms, x, res, w), f"rms_norm {cols} columns")
    gu = randn(5, 2 * 14336)
    same(*both_ways(monkeypatch, lambda: [triton_ops.silu_mul(gu)]), "silu_mul")

    heads, kv_heads, blocks, bs = 32, 8, 64, 16
    cos, sin = randn(4096, d // 2, dt=torch.float32), randn(4096, d // 2, dt=torch.float32)
    qkv0 = randn(6, (heads + 2 * kv_heads) * d)
    pos = torch.tensor([0, 3, 7, 60, 2, 4000], dtype=torch.int32, device=dev)
    slots = torch.tensor([0, 5, -1, 23, 9, 1000], dtype=torch.int32, device=dev)
    def rope(qk_norms):
        qkv, caches = qkv0.clone(), torch.zeros(2, blocks, bs, kv_heads, d, dtype=dtype, device=dev)
        triton_ops.qk_rope_cache(qkv, pos, cos, sin, caches[0], caches[1], slots, heads, kv_heads, *qk_norms, 1e-6)
        return qkv, caches

    for qk_norms in ((None, None), (randn(d), randn(d))):
        same(*both_ways(monkeypatch, rope, qk_norms), f"qk_rope_cache qk_norm={qk_norms[0] is not None}")

    # decode: GQA groups of 4 and of 32 (two programs a KV head), contexts up to 9000 tokens (18 splits)
    nblocks = 9000 // bs + 8
    for heads, kv_heads in ((32, 8), (32, 1)):
        k_cache, v_cache = randn(nblocks, bs, kv_heads, d), randn(nblocks, bs, kv_heads, d)
        ctx = torch.tensor([1, 130, 9000, 0], dtype=torch.int32, device=dev)
        tables = torch.randint(0, nblocks, (4, 9000 // bs + 1), generator=gen, device=dev, dtype=torch.int32)
        qkv = randn(4, (heads + 2 * kv_heads) * d)
        q = qkv[:, :heads * d].view(4, heads, d)
        ws = paged_attention.DecodeWorkspace(4, heads, d, tables.shape[1] * bs, dev)
        got = both_ways(monkeypatch, decode, q, k_cache, v_cache, tables, ctx, ws)
        same(*got, f"decode_attention {heads}/{kv_heads} heads")
        want = layers.decode_attention(q[:3], k_cache, v_cache, tables[:3], ctx[:3], d ** -0.5)
        err = ((got[0][0].float() - want.float()).norm() / want.float().norm()).item()
        assert err < (1e-5 if dtype == torch.float32 else 2e-2), f"decode_attention against torch: {err:.2e}"

    if dtype != torch.float32:                # float32 prefill is not shipped (ops_kernels.HALF_DTYPES)
        k_cache, v_cache = randn(64, bs, 8, d), randn(64, bs, 8, d)
        query_lens, context_lens = [5, 100, 1, 70], [5, 161, 30, 70]
        perm, tables = torch.randperm(64).tolist(), []
        for c in context_lens:
            tables.append(perm[:-(-c // bs)])
            perm = perm[len(tables[-1]):]
        plan = paged_attention.PrefillPlan(tables, query_lens, context_lens, dev)
        q = randn(sum(query_lens), 32, d)
        got = both_ways(monkeypatch, lambda: [paged_attention.prefill_attention(q, k_cache, v_cache, plan, d ** -0.5)])
        same(*got, "prefill_attention")
        tables = [torch.tensor(t, dtype=torch.int32, device=dev) for t in tables]   # SDPA over the gathered pages
        parts, start = [], 0
        for n, c, t in zip(query_lens, context_lens, tables, strict=True):
            rows = (t.long()[:, None] * bs + torch.arange(bs, device=dev)).flatten()[c - n:c]
            k, v = k_cache.flatten(0, 1)[rows], v_cache.flatten(0, 1)[rows]
            parts.append(layers.prefill_attention(q[start:start + n], k, v, k_cache, v_cache, [t], [n], [c],
                                                  d ** -0.5))
            start += n
        want = torch.cat(parts)
        err = ((got[0][0].float() - want.float()).norm() / want.float().norm()).item()
        assert err < 2e-2, f"prefill_attention against torch: {err:.2e}"


def test_generate_on_the_per_op_backend_needs_no_triton():
    """`warploop generate --backend torch` on the GPU in a process where importing Triton fails."""
    from no_triton import BLOCK_TRITON

    argv = ["generate", "--model", "tiny", "--device", "cuda", "--dtype", "bfloat16", "--backend", "torch",
            "--prompt", "The capital of France is", "--max-tokens", "16", "--json"]
    code = BLOCK_TRITON + f"from warploop.cli import main\nsys.exit(main({argv!r}))\n"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": root})
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["backend"] == "torch" and out["token_ids"], out
