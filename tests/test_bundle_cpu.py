"""build -> inspect -> load -> run on the CPU executor, against torch; launch-time variant choice."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import warploop

ROOT = Path(__file__).resolve().parents[1]
KERNELS = ROOT / "examples" / "kernels.py"


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    out = tmp_path_factory.mktemp("cpu") / "k.wlb"
    build = [sys.executable, "-m", "warploop.cli", "bundle", "build", str(KERNELS), "-t", "cuda:90", "-t", "cpu",
             "-k", "add", "-k", "softmax", "-k", "matmul", "-q", "-o", str(out)]
    subprocess.run(build, check=True, capture_output=True)
    listed = json.loads(subprocess.run([sys.executable, "-m", "warploop.cli", "bundle", "inspect", str(out), "--json"],
                                       check=True, capture_output=True, text=True).stdout)
    assert {v["target"] for k in listed["kernels"] for v in k["variants"]} == {"cuda:90", "cpu"}
    return warploop.load_bundle(out, device="cpu")


def rel_err(got, ref):
    return float((got.double() - ref.double()).norm() / ref.double().norm())


def test_vector_add(bundle):
    x, y = torch.randn(3000), torch.randn(3000)
    out = torch.full_like(x, float("nan"))
    bundle.add[(3,)](x, y, out, 3000)
    assert torch.equal(out, x + y)


def test_row_softmax(bundle):
    x = torch.randn(5, 900)
    out = torch.full_like(x, float("nan"))
    bundle.softmax[(5,)](x, out, 900, 900)
    assert rel_err(out, torch.softmax(x.double(), dim=1)) < 1e-6


def test_tiled_matmul_with_callable_grid(bundle):
    a, b = torch.randn(100, 70, dtype=torch.float16), torch.randn(70, 90, dtype=torch.float16)
    c = torch.full((100, 90), float("nan"))
    seen = {}

    def grid(meta):
        seen.update(meta)
        return (-(-100 // meta["BM"]), -(-90 // meta["BN"]))

    bundle.matmul[grid](a, b, c, 100, 90, 70)
    assert rel_err(c, a.double() @ b.double()) < 1e-3
    assert seen["BM"] == 64 and seen["num_warps"] == 4 and seen["K"] == 70  # Triton's meta dict


def test_launch_picks_the_aligned_export_only_when_pointers_allow(bundle):
    kernel = bundle.add
    assert [s.spec.specialize for s in kernel.specs] == [{"x": 16, "y": 16, "out": 16}, {}]  # most specialized first
    assert bundle.chosen()["add"][0]["format"] == "source"
    base = torch.randn(2049)
    x, y, out = base[1:], torch.randn(2048), torch.zeros(2048)  # x is 4 bytes past a 16-byte boundary
    kernel[(2,)](x, y, out, 2048)
    assert torch.equal(out, x + y)


def test_constexprs_by_keyword_or_position(bundle):
    x, y = torch.randn(100), torch.randn(100)
    out = torch.zeros(100)
    bundle.add[(1,)](x, y, out, 100, BLOCK=1024)
    assert torch.equal(out, x + y)
    out.zero_()
    bundle.add[(1,)](x, y, out, 100, 1024)
    assert torch.equal(out, x + y)


def test_bundle_object(bundle):
    assert set(bundle) == {"add", "softmax", "matmul"} and bundle["add"] is bundle.add and bundle.softmax
    with pytest.raises(AttributeError, match="has no kernel 'nope'; it has add, softmax, matmul"):
        _ = bundle.nope
    assert "on cpu" in repr(bundle) and "add(x, y, out, n, BLOCK)" in repr(bundle.add)


def test_tutorial_runs():
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "bundle_demo.py")], capture_output=True, text=True,
                          env={**os.environ, "WARPLOOP_DEVICE": "cpu"})
    assert proc.returncode == 0, proc.stderr
    assert "largest difference from torch" in proc.stdout


def test_bench_runs_on_the_cpu(tmp_path):
    """`warploop bench bundle` on a machine with no GPU: every kernel checked, GPU-only keys null."""
    path = tmp_path / "all.wlb"
    subprocess.run([sys.executable, "-m", "warploop.cli", "bundle", "build", str(KERNELS), "-t", "cpu", "-q",
                    "-o", str(path)], check=True, capture_output=True)
    proc = subprocess.run([sys.executable, "-m", "warploop.cli", "bench", "bundle", "--json", "--bundle", str(path),
                           "--repeats", "1"],
                          capture_output=True, text=True, env={**os.environ, "WARPLOOP_DEVICE": "cpu"})
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["all_correct"] is True and len(data["kernels"]) == 12
    assert data["cold_start_s"] > 0 and data["device"] == "cpu"
    for key in ("triton_cold_start_s", "launch_us", "triton_launch_us", "raw_launch_us"):
        assert data[key] is None


def test_cpu_executor_leaves_triton_able_to_compile(bundle, tmp_path, monkeypatch):
    """The interpreter patches triton.language while it runs (and, in Triton 3.6, leaks patches from
    nested calls such as tl.sum): a GPU compile in the same process afterwards must still work."""
    from warploop.bundle.build import build_bundle

    x, out = torch.randn(2, 64), torch.empty(2, 64)
    for _ in range(2):  # the second run reuses the interpreter's cached rewrites
        bundle.softmax[(2,)](x, out, 64, 64)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))  # force a real compile
    build_bundle(KERNELS, ["cuda:90"], tmp_path / "after.wlb", jobs=1, progress=False, only=["softmax"])
    bundle.softmax[(2,)](x, out, 64, 64)
    assert torch.allclose(out, torch.softmax(x, 1))
