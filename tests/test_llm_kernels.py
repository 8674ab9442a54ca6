"""The GPU path's Triton kernels against the PyTorch ops they replace, on the CPU through the Triton
interpreter (a subprocess, because TRITON_INTERPRET must be set before the kernels are defined).
On a GPU the same checks run natively."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch


def runtime_loops_run() -> bool:
    """Whether Triton runs a for loop over bounds loaded at run time, as prefill_kernel's pipelined
    loops are: always when compiled; in the interpreter from some release after 3.6 (3.9 does, 3.6
    fails converting the bound), so the interpreter child probes it."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return True
    import triton
    import triton.language as tl

    @triton.jit
    def count(n_ptr, out_ptr):
        total = 0
        for _ in tl.range(0, tl.load(n_ptr)):
            total += 1
        tl.store(out_ptr, total)

    n, out = torch.tensor([3], dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    try:
        count[(1,)](n, out)
    except Exception as e:   # noqa: BLE001 (Triton 3.6's interpreter: InterpreterError from a TypeError)
        print(f"this Triton's interpreter cannot run prefill_kernel's loops ({type(e).__name__}): its checks skip")
        return False
    return int(out[0]) == 3


def check_kernels(device: str) -> None:
    from warploop.llm import paged_attention

    tiles = paged_attention.PARTITION, paged_attention.PREFILL_BM, paged_attention.PREFILL_BN
    try:
        check_kernels_at_test_tiles(device)
    finally:  # the shipped bundle's tiles again, for the tests after this one (on a GPU, in this process)
        paged_attention.PARTITION, paged_attention.PREFILL_BM, paged_attention.PREFILL_BN = tiles


def check_kernels_at_test_tiles(device: str) -> None:
    from warploop.llm import layers, paged_attention, triton_ops
    from warploop.llm.rope import RopeConfig, cos_sin_table

    gen = torch.Generator().manual_seed(0)

    def randn(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    def close(a, b, tol, what):
        err = ((a.float() - b.float()).norm() / b.float().norm()).item()
        assert err <= tol, f"{what}: relative error {err:.2e} > {tol:.0e}"

    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 2e-2)):
        x, res, w = randn(5, 48, dtype=dtype), randn(5, 48, dtype=dtype), randn(48, dtype=dtype)
        for residual in (None, res):
            want, want_res = layers.rms_norm(x, w, 1e-6, residual)
            got, got_res = triton_ops.rms_norm(x, w, 1e-6, None if residual is None else residual.clone())
            close(got, want, tol, f"rms_norm {dtype} residual={residual is not None}")
            close(got_res, want_res, tol, "rms_norm residual out")
        # rows wider than rms_norm's widest block (8192) take its loop over column blocks
        x, res, w = randn(2, 8192 + 48, dtype=dtype), randn(2, 8192 + 48, dtype=dtype), randn(8192 + 48, dtype=dtype)
        for residual in (None, res):
            want, want_res = layers.rms_norm(x, w, 1e-6, residual)
            got, got_res = triton_ops.rms_norm(x, w, 1e-6, None if residual is None else residual.clone())
            close(got, want, tol, f"rms_norm, 8240 columns, {dtype} residual={residual is not None}")
            close(got_res, want_res, tol, "rms_norm residual out, 8240 columns")
        gu = randn(3, 2 * 200, dtype=dtype)
        close(triton_ops.silu_mul(gu), layers.silu_mul(gu), tol, f"silu_mul {dtype}")

        heads, kv_heads, d, blocks, bs = 4, 2, 16, 6, 4
        cos, sin = (t.to(device) for t in cos_sin_table(RopeConfig(), d, 64))
        for qk_norm in (False, True):
            qkv = randn(5, (heads + 2 * kv_heads) * d, dtype=dtype)
            pos = torch.tensor([0, 3, 7, 60, 2], dtype=torch.int32, device=device)
            slots = torch.tensor([0, 5, -1, 23, 9], dtype=torch.int32, device=device)
            qn, kn = (randn(d, dtype=dtype), randn(d, dtype=dtype)) if qk_norm else (None, None)
            caches = [torch.zeros(blocks, bs, kv_heads, d, dtype=dtype, device=device) for _ in range(4)]
            want = layers.qk_rope_cache(qkv.clone(), pos, cos, sin, caches[0], caches[1], slots, heads, kv_heads,
                                        qn, kn, 1e-6)
            got = triton_ops.qk_rope_cache(qkv.clone(), pos, cos, sin, caches[2], caches[3], slots, heads, kv_heads,
                                           qn, kn, 1e-6)
            for a, b, name in zip(got, want, "qkv", strict=True):
                close(a, b, tol, f"qk_rope_cache {name} {dtype} qk_norm={qk_norm}")
            close(caches[2], caches[0], tol, "k cache")
            close(caches[3], caches[1], tol, "v cache")

    paged_attention.PARTITION = 128  # several splits per sequence at test sizes
    # the Triton 3.6 interpreter computes bf16 tl.dot wrongly (fp16 and fp32 are right): bf16 on GPUs only
    halves = (torch.float16,) if device == "cpu" else (torch.float16, torch.bfloat16)
    for dtype, tol in ((torch.float32, 1e-5), *((h, 2e-2) for h in halves)):
        for bs, heads, kv_heads in ((1, 4, 4), (4, 8, 2), (16, 8, 1)):
            d, nblocks = 32, 400 // bs + 8
            k_cache = randn(nblocks, bs, kv_heads, d, dtype=dtype)
            v_cache = randn(nblocks, bs, kv_heads, d, dtype=dtype)
            ctx = torch.tensor([1, 130, 300, 0], dtype=torch.int32, device=device)  # the last row is padding
            width = 300 // bs + 1
            tables = torch.randint(0, nblocks, (4, width), generator=gen).to(device=device, dtype=torch.int32)
            qkv = randn(4, (heads + 2 * kv_heads) * d, dtype=dtype)
            q = qkv[:, : heads * d].view(4, heads, d)  # strided rows, as the backend passes it
            ws = paged_attention.DecodeWorkspace(4, heads, d, width * bs, device)
            got = paged_attention.decode_attention(q, k_cache, v_cache, tables, ctx, d ** -0.5, ws)
            want = layers.decode_attention(q[:3], k_cache, v_cache, tables[:3], ctx[:3], d ** -0.5)
            close(got[:3], want, tol, f"decode_attention bs={bs} heads={heads}/{kv_heads} {dtype}")

    # a GQA group wider than a decode program's 16 heads (two programs a KV head), and more splits
    # (19 at PARTITION 16) than the merge reads at a time
    paged_attention.PARTITION = 16
    # float32 only in the interpreter (its slowest launches): the half-precision paths are those above
    wide = ((torch.float32, 1e-5), *((h, 2e-2) for h in halves if device != "cpu"))
    for dtype, tol in wide:
        bs, heads, kv_heads, d, nblocks = 16, 40, 2, 32, 40
        k_cache = randn(nblocks, bs, kv_heads, d, dtype=dtype)
        v_cache = randn(nblocks, bs, kv_heads, d, dtype=dtype)
        ctx = torch.tensor([1, 130, 300, 0], dtype=torch.int32, device=device)
        width = 300 // bs + 1
        tables = torch.randint(0, nblocks, (4, width), generator=gen).to(device=device, dtype=torch.int32)
        q = randn(4, heads, d, dtype=dtype)
        ws = paged_attention.DecodeWorkspace(4, heads, d, width * bs, device)
        got = paged_attention.decode_attention(q, k_cache, v_cache, tables, ctx, d ** -0.5, ws)
        want = layers.decode_attention(q[:3], k_cache, v_cache, tables[:3], ctx[:3], d ** -0.5)
        close(got[:3], want, tol, f"decode_attention group 20, 19 splits, {dtype}")

    # prefill from the pages: fresh prompts and cached prefixes, several sequences in one launch
    if not runtime_loops_run():
        return
    paged_attention.PREFILL_BM = paged_attention.PREFILL_BN = 16    # several query blocks and key steps
    for dtype, tol in ((torch.float32, 1e-5), *((h, 2e-2) for h in halves)):
        for bs, heads, kv_heads in ((4, 4, 2), (16, 4, 4)):
            d, nblocks = 32, 64
            k_cache = randn(nblocks, bs, kv_heads, d, dtype=dtype)
            v_cache = randn(nblocks, bs, kv_heads, d, dtype=dtype)
            query_lens, context_lens = [5, 40, 1, 23], [5, 61, 30, 23]      # fresh, prefix, one token, fresh
            perm = torch.randperm(nblocks, generator=gen).tolist()
            tables, used = [], 0
            for c in context_lens:
                n = -(-c // bs)
                tables.append(perm[used:used + n])
                used += n
            q = randn(sum(query_lens), heads, d, dtype=dtype)
            # the new tokens' k and v, as the cache holds them (qk_rope_cache wrote them there)
            new_k, new_v = [], []
            for table, n, c in zip(tables, query_lens, context_lens, strict=True):
                toks = torch.arange(c - n, c)
                blk = torch.tensor(table)[toks // bs]
                new_k.append(k_cache[blk, toks % bs])
                new_v.append(v_cache[blk, toks % bs])
            want = layers.prefill_attention(q, torch.cat(new_k), torch.cat(new_v), k_cache, v_cache,
                                            [torch.tensor(t, dtype=torch.int32, device=device) for t in tables],
                                            query_lens, context_lens, d ** -0.5)
            plan = paged_attention.PrefillPlan(tables, query_lens, context_lens, device)
            got = paged_attention.prefill_attention(q, k_cache, v_cache, plan, d ** -0.5)
            close(got, want, tol, f"prefill_attention bs={bs} heads={heads}/{kv_heads} {dtype}")


def check_backend_with_kernels(device: str) -> None:
    """The whole model through the kernel path gives the logits and tokens of the plain-torch path."""
    from warploop.llm.backend_torch import TorchBackend
    from warploop.llm.config import ModelConfig
    from warploop.llm.cuda_graphs import PrefillGraphs
    from warploop.llm.engine import Engine
    from warploop.llm.kv_cache import KVCacheLayout
    from warploop.llm.params import SamplingParams
    from warploop.llm.weights import random_weights

    # llm_helpers.SMALL's qwen3 (q and k norms, 4 query heads on 2 KV heads), built here rather than
    # saved and loaded through transformers (its import alone is ~10 s); weights spread as a
    # checkpoint made with initializer_range 0.3, norms not all ones
    cfg = ModelConfig(family="qwen3", vocab_size=258, hidden_size=64, intermediate_size=128, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=512, qk_norm=True)
    weights = random_weights(cfg, device, torch.float32)
    gen = torch.Generator().manual_seed(1)
    tensors = [weights.embed, weights.lm_head, weights.norm]
    for t in tensors + [t for lw in weights.layers for t in vars(lw).values() if t is not None]:
        if t.dim() == 1:
            t.add_(0.1 * torch.randn(t.shape, generator=gen).to(device))
        else:
            t.mul_(0.3 / 0.02)      # random_weights draws with std 0.02
    outs = []
    shared = [256, *range(40, 48)]          # two blocks of 4 the later prompts find cached
    # (use_triton, paged_prefill, prefill graphs): the last replays CUDA graphs on a GPU, and runs the
    # graphs' padded buffers eagerly in the interpreter
    modes = ((False, "off", False), (True, "off", False), (True, "prefix", False), (True, "all", False),
             (True, "all", True))
    for use_triton, paged, graphed in modes if runtime_loops_run() else modes[:2]:
        layout = KVCacheLayout(cfg.num_layers, 64, 4, cfg.num_kv_heads, cfg.head_dim, "float32")
        backend = TorchBackend(cfg, weights, layout, device, max_context=256, use_triton=use_triton)
        backend.paged_prefill = paged      # prefix hits and chunks after the first (all: every prompt) attend
        # from the pages
        with Engine(cfg, backend, max_context=256, max_num_seqs=4, max_prefill_tokens=7) as engine:
            if graphed:
                backend.prefill_graphs = PrefillGraphs(backend, 7)      # one bucket: prefills of up to 7 tokens
            # 2 decode steps: each reads every cached position; four prompts' decodes open a block
            params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
            # fresh prompts of 3, 7 and 11 tokens (one chunk, one full chunk, two chunks), then 10 (two
            # chunks), and 13 and 16 whose 8 cached tokens leave one and two chunks to prefill
            outs.append([engine.generate([256, *range(i, i + 2 + 4 * i)], params).token_ids for i in range(3)]
                        + [engine.generate(shared + list(range(i, i + 1 + 3 * i)), params).token_ids
                           for i in range(3)])
            assert engine.stats()["prefill_chunks"] > 0
            assert not graphed or backend.prefill_graphs.runs >= 6, "the prefills did not run through the graphs"
    assert all(out == outs[0] for out in outs[1:]), outs


def in_interpreter(part: str) -> None:
    tests = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([os.path.dirname(tests), tests])}
    run = subprocess.run([sys.executable, __file__, part], env=env, capture_output=True, text=True, timeout=400)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert f"{part} ok" in run.stdout


# two children, so CI's two workers run them side by side
def test_triton_kernels_match_torch_ops_in_interpreter():
    in_interpreter("kernels")


def test_the_model_on_the_kernels_matches_torch_in_interpreter():
    in_interpreter("backend")


@pytest.mark.gpu
def test_triton_kernels_match_torch_ops_on_gpu():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    check_kernels("cuda")
    check_backend_with_kernels("cuda")


def launch_through_the_interpreter_bridge() -> None:
    """The child's per-op kernels run through warploop's interpreter bridge (runtime/interp.py, the
    CPU executor's) rather than straight from `kernel[grid]`: the same kernels in the same Triton
    interpreter, but triton.language is patched once a launch instead of at every device-function
    call, and the integer overflow check, whose result the interpreter drops without TRITON_DEBUG,
    is not computed. The children take 60% of the time (the backend's: 31 s -> 18 s on one core)."""
    from warploop.llm import ops_kernels, ops_prebuilt
    from warploop.runtime import interp

    def jit_launch(name, grid, args, constexprs, num_warps):    # num_warps: nothing to the interpreter
        interp.launch(getattr(ops_kernels, name), grid, *args, **constexprs)

    ops_prebuilt.jit_launch = jit_launch


if __name__ == "__main__":
    launch_through_the_interpreter_bridge()
    {"kernels": check_kernels, "backend": check_backend_with_kernels}[sys.argv[1]]("cpu")
    print(f"{sys.argv[1]} ok")
