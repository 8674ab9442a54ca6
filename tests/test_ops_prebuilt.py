"""The per-op GPU kernels' shipped bundle (warploop/llm/shipped/ops.wlb) and the dispatch that launches
from it, on the CPU: the bundle is current and holds what it must; the wrappers of every model shape
reach it on a GPU (one faked by NullDriver, which records launches and runs nothing) and reach Triton's
JIT only where it has no fitting specialization; the bundle path imports no Triton (a child process
that cannot import it); listing() for `warploop info --json`. tests/test_ops_prebuilt_gpu.py runs the
bundle on a real GPU against the JIT."""
from __future__ import annotations

import ast
import json
import logging
import os
import subprocess
import sys
import time

import pytest
import torch
from no_triton import BLOCK_TRITON

from warploop.bundle.format import BundleFile
from warploop.bundle.load import load_bundle
from warploop.driver.null import NullDriver
from warploop.llm import ops_prebuilt, paged_attention, triton_ops
from warploop.target import DeviceInfo, Target, probe_devices

KERNELS = ("rms_norm_kernel", "silu_mul_kernel", "qk_rope_cache_kernel", "decode_split_kernel",
           "decode_merge_kernel", "prefill_kernel")
# (hidden, intermediate, heads, kv heads, head dim, q/k norm)
SHAPES = {
    "smollm2-135m": (576, 1536, 9, 3, 64, False),
    "qwen3-0.6b": (1024, 3072, 16, 8, 128, True),
    "llama-3.2-1b": (2048, 8192, 32, 8, 64, False),
    "llama-3.1-8b": (4096, 14336, 32, 8, 128, False),
    "qwen3-32b": (5120, 25600, 64, 8, 128, True),
    "llama-3.1-70b": (8192, 28672, 64, 8, 128, False),
    "group-32": (4096, 16384, 32, 1, 128, False),              # a GQA group over two decode programs
    "llama-3.1-405b": (16384, 53248, 128, 8, 128, False),      # rms_norm's loop over column blocks
}


def fake_gpu(target: str) -> tuple:
    """The shipped bundle as loaded on a `target` GPU, through NullDriver (index -1: CPU tensors pass
    its device check)."""
    info = DeviceInfo(target=Target.parse(target), index=-1, name=f"fake {target}", sm_count=132,
                      shared_mem_optin=232448, driver_version=13000)
    driver = NullDriver(info)
    return load_bundle(ops_prebuilt.SHIPPED, driver=driver, allow_python=False), driver


def serve_from(bundle, set_attr) -> list[str]:
    """Make ops_prebuilt take CPU tensors for CUDA ones and `bundle` for the shipped one; returns the
    list of kernels that go to Triton's JIT instead (which then runs nothing)."""
    jitted: list[str] = []
    set_attr(ops_prebuilt, "cuda_index", lambda tensor: 0)
    set_attr(ops_prebuilt, "shipped", lambda index: bundle)
    set_attr(ops_prebuilt, "_views", {})
    set_attr(ops_prebuilt, "jit_launch", lambda name, *rest: jitted.append(name))
    return jitted


def run_wrappers(shape: tuple, dtype: torch.dtype, rows: int = 3) -> list[str]:
    """Every wrapper once (rms_norm twice), at a model's shapes; returns the kernels in launch order."""
    hidden, inter, heads, kv_heads, d, qk_norm = shape
    gen = torch.Generator().manual_seed(0)

    def randn(*size, dt=dtype):
        return torch.randn(*size, generator=gen).to(dt)

    x, res, w = randn(rows, hidden), randn(rows, hidden), randn(hidden)
    triton_ops.rms_norm(x, w, 1e-6)
    triton_ops.rms_norm(x, w, 1e-6, res)
    triton_ops.silu_mul(randn(rows, 2 * inter))
    qkv = randn(rows, (heads + 2 * kv_heads) * d)
    cos, sin = randn(64, d // 2, dt=torch.float32), randn(64, d // 2, dt=torch.float32)
    cache = torch.zeros(2, 8, 16, kv_heads, d, dtype=dtype)
    positions = torch.arange(rows, dtype=torch.int32)
    norms = (randn(d), randn(d)) if qk_norm else (None, None)
    q, _, _ = triton_ops.qk_rope_cache(qkv, positions, cos, sin, cache[0], cache[1], positions.clone(), heads,
                                       kv_heads, *norms, 1e-6)
    tables, ctx = torch.zeros(rows, 4, dtype=torch.int32), torch.full((rows,), 5, dtype=torch.int32)
    workspace = paged_attention.DecodeWorkspace(rows, heads, d, 4 * 16, "cpu")
    paged_attention.decode_attention(q, cache[0], cache[1], tables, ctx, d ** -0.5, workspace)
    plan = paged_attention.PrefillPlan([[0]] * rows, [1] * rows, [1] * rows, "cpu")
    paged_attention.prefill_attention(q, cache[0], cache[1], plan, d ** -0.5)
    return ["rms_norm_kernel", "rms_norm_kernel", "silu_mul_kernel", "qk_rope_cache_kernel", "decode_split_kernel",
            "decode_merge_kernel", "prefill_kernel"]


def test_shipped_bundle_is_current():
    ops_prebuilt.stale.cache_clear()
    assert ops_prebuilt.stale() is None, ops_prebuilt.stale()


def test_a_stale_bundle_says_how_to_rebuild_it_and_is_not_used(tmp_path, monkeypatch, caplog):
    edited = tmp_path / "ops_kernels.py"
    edited.write_text(ops_prebuilt.KERNELS.read_text() + "\n# an edit\n")
    monkeypatch.setattr(ops_prebuilt, "KERNELS", edited)
    ops_prebuilt.stale.cache_clear()
    try:
        why = ops_prebuilt.stale()
        assert why and "built from another ops_kernels.py" in why and "scripts/ops_bundle.py" in why, why
        monkeypatch.setattr(ops_prebuilt, "_bundles", {})
        monkeypatch.setattr(ops_prebuilt, "_said", set())
        with caplog.at_level(logging.WARNING, logger="warploop.llm"):
            assert ops_prebuilt.shipped(0) is None and ops_prebuilt.shipped(1) is None   # two GPUs, one line
        assert [r.getMessage() for r in caplog.records] == [f"{why}; the per-op GPU kernels compile with Triton "
                                                            "instead"]
        assert all(e["current"] is False for e in ops_prebuilt.listing())
    finally:
        ops_prebuilt.stale.cache_clear()


def test_shipped_bundle_holds_every_listed_specialization():
    manifest = BundleFile(ops_prebuilt.SHIPPED).manifest
    assert manifest.build["versions"]["triton"] == "3.6.0", "build it with Triton 3.6.0 (scripts/ops_bundle.py)"
    assert sorted(manifest.targets) == ["cuda:80", "cuda:90"]
    listed = {(e["kernel"], e["target"], e["dtype"], e["head_dim"]) for e in ops_prebuilt.listing()}
    want = set()
    for target in ("cuda:90", "cuda:80"):
        for dtype in ("bfloat16", "float16", "float32"):
            want |= {(k, target, dtype, None) for k in ("rms_norm_kernel", "silu_mul_kernel")}
            for d in (64, 128):
                want |= {(k, target, dtype, d) for k in KERNELS[2:]
                         if not (k == "prefill_kernel" and dtype == "float32")}
    assert listed == want
    for kernel in manifest.kernels:
        for s in kernel.specializations:
            for v in s.variants:
                # a CUDA graph captures these launches: a kernel that needed scratch would allocate in it
                assert v.global_scratch_size == 0 and v.profile_scratch_size == 0, (kernel.name, s.spec.label())
                assert set(v.formats) == ({"cubin"} if v.target == "cuda:90" else {"cubin", "ptx"})
                assert v.toolchain["cubin_needs"]["cuda"].startswith("12."), v.toolchain
            if kernel.name == "rms_norm_kernel":
                assert s.spec.num_warps == triton_ops.row_warps(s.spec.constexprs["BLOCK"])
                assert s.spec.constexprs["BLOCK"] in triton_ops.ROW_BLOCKS


@pytest.mark.parametrize("target", ["cuda:90", "cuda:80"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_every_model_shape_launches_from_the_bundle(target, dtype, monkeypatch):
    bundle, driver = fake_gpu(target)
    jitted = serve_from(bundle, monkeypatch.setattr)
    for name, shape in SHAPES.items():
        before = len(driver.launches)
        jitted.clear()
        order = run_wrappers(shape, dtype)
        # float32 prefill is not shipped (ops_kernels.HALF_DTYPES): it alone JITs
        assert jitted == (["prefill_kernel"] if dtype == torch.float32 else []), name
        assert [launch.function[0] for launch in driver.launches[before:]] == order[:len(order) - len(jitted)], name
        rms_block = triton_ops.row_block(shape[0])
        assert driver.launches[before].block == 32 * triton_ops.row_warps(rms_block)
        split = driver.launches[before + 4]
        assert split.grid == (3, shape[3] * -(shape[2] // shape[3] // -16), 1), name
    assert {f for _, f, _ in (launch.function for launch in driver.launches)} == {"cubin"}


def test_the_jit_takes_what_the_bundle_does_not_fit(monkeypatch, caplog):
    bundle, driver = fake_gpu("cuda:90")
    jitted = serve_from(bundle, monkeypatch.setattr)
    monkeypatch.setattr(ops_prebuilt, "_said", set())
    x, w = torch.randn(2, 2048, dtype=torch.bfloat16), torch.randn(2048, dtype=torch.bfloat16)
    triton_ops.rms_norm(x, w, 1e-6)
    assert (len(driver.launches), jitted) == (1, [])
    misaligned = torch.empty(2 * 2048 + 1, dtype=torch.bfloat16)[1:].view(2, 2048)      # 2 bytes off
    with caplog.at_level(logging.INFO, logger="warploop.llm"):
        triton_ops.rms_norm(misaligned, w, 1e-6)
        triton_ops.rms_norm(x[:, :200].contiguous(), w[:200], 1e-6)      # 200 columns: not divisible by 16
    assert (len(driver.launches), jitted) == (1, ["rms_norm_kernel", "rms_norm_kernel"])
    assert "does not fit" in caplog.text
    jitted.clear()
    run_wrappers((256, 768, 4, 2, 32, True), torch.bfloat16)           # head dim 32: not shipped
    assert len(driver.launches) == 1 + 3 and jitted == ["qk_rope_cache_kernel", "decode_split_kernel",
                                                        "decode_merge_kernel", "prefill_kernel"]
    jitted.clear()
    monkeypatch.setattr(paged_attention, "PARTITION", 128)             # tiles the tests use: not shipped
    run_wrappers(SHAPES["llama-3.2-1b"], torch.bfloat16)
    assert jitted == ["decode_split_kernel", "decode_merge_kernel"]
    jitted.clear()
    with ops_prebuilt.jit_only():
        triton_ops.rms_norm(x, w, 1e-6)
    assert jitted == ["rms_norm_kernel"]


def test_cpu_tensors_and_a_machine_without_cuda_take_the_jit(monkeypatch, caplog):
    jitted: list[str] = []
    monkeypatch.setattr(ops_prebuilt, "jit_launch", lambda name, *rest: jitted.append(name))
    monkeypatch.setattr(ops_prebuilt, "_views", {})
    monkeypatch.setattr(ops_prebuilt, "_bundles", {})
    monkeypatch.setattr(ops_prebuilt, "_said", set())
    triton_ops.silu_mul(torch.randn(2, 2048, dtype=torch.bfloat16))     # a CPU tensor: never the bundle
    assert jitted == ["silu_mul_kernel"] and ops_prebuilt._bundles == {}
    if any(d.target.backend == "cuda" for d in probe_devices()):
        return
    with caplog.at_level(logging.WARNING, logger="warploop.llm"):     # asked for device 0 of a machine with none
        assert ops_prebuilt.shipped(0) is None
    assert "the CUDA driver shows no device 0" in caplog.text


@pytest.mark.parametrize("target,chosen", [("cuda:86", ("cuda:80", "cubin")), ("cuda:100", ("cuda:80", "ptx"))])
def test_other_gpus_load_the_cuda80_variants(target, chosen):
    bundle, _ = fake_gpu(target)
    picks = {(c["target"], c["format"]) for kernel in bundle.chosen().values() for c in kernel}
    assert picks == {chosen}


def test_listing():
    start = time.perf_counter()
    entries = ops_prebuilt.listing()
    assert time.perf_counter() - start < 0.5
    assert len(entries) == 2 * (3 + 3 + 6 + 6 + 6 + 4)     # per target: rms, silu, qk_rope, split, merge, prefill
    assert all(set(e) == {"kind", "kernel", "target", "dtype", "head_dim", "current"} for e in entries)
    assert {"kind": "ops", "kernel": "decode_split_kernel", "target": "cuda:90", "dtype": "bfloat16",
            "head_dim": 128, "current": True} in entries
    assert {"kind": "ops", "kernel": "rms_norm_kernel", "target": "cuda:80", "dtype": "float16", "head_dim": None,
            "current": True} in entries
    json.dumps(entries)


def test_kernels_file_stands_alone():
    """A bundle's cpu variant carries ops_kernels.py alone: it may import Triton and warploop only."""
    tree = ast.parse(ops_prebuilt.KERNELS.read_text())
    imported = {a.name for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names}
    imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert imported == {"triton", "triton.language", "warploop"}


def test_bundle_path_imports_no_triton():
    """Importing the wrappers (and the per-op backend), launching every kernel from the bundle, and
    listing() all run in a process where importing Triton fails."""
    tests = os.path.dirname(os.path.abspath(__file__))
    code = BLOCK_TRITON + f"""
sys.path.insert(0, {tests!r})
import json, test_ops_prebuilt as t
from warploop.llm import backend_torch, ops_prebuilt
bundle, driver = t.fake_gpu("cuda:90")
jitted = t.serve_from(bundle, setattr)
order = t.run_wrappers(t.SHAPES["qwen3-0.6b"], t.torch.bfloat16)
entries = ops_prebuilt.listing()
print(json.dumps({{"launched": [f[0] for f in (x.function for x in driver.launches)], "order": order,
                  "jitted": jitted, "listed": len(entries), "stale": ops_prebuilt.stale(),
                  "triton": sorted(m for m in sys.modules if m.split(".")[0] == "triton")}}))
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": os.path.dirname(tests)})
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.splitlines()[-1])
    assert out["launched"] == out["order"] and out["jitted"] == [] and out["triton"] == []
    assert out["listed"] > 0 and out["stale"] is None
