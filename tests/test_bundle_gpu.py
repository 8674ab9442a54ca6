"""Bundles on a real NVIDIA GPU (skipped elsewhere): driver loading, PTX JIT, checks against the device."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import warploop
from warploop.bundle.args import LaunchError
from warploop.bundle.build import build_bundle
from warploop.target import select_device

KERNELS = Path(__file__).resolve().parents[1] / "examples" / "kernels.py"

pytestmark = pytest.mark.gpu
if select_device().target.backend != "cuda" or not torch.cuda.is_available():
    pytest.skip("needs an NVIDIA GPU", allow_module_level=True)


@pytest.fixture(scope="module")
def exact(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu") / "exact.wlb"
    build_bundle(KERNELS, [str(select_device().target)], out, jobs=1, progress=False,
                 only=["add", "softmax", "matmul"])
    return out


def test_exact_variant_runs_and_matches_torch(exact):
    b = warploop.load_bundle(exact)
    assert b.chosen()["add"][0]["format"] == "cubin"
    x, y = torch.randn(10_000, device="cuda"), torch.randn(10_000, device="cuda")
    out = torch.full_like(x, float("nan"))
    b.add[(10,)](x, y, out, 10_000)
    torch.cuda.synchronize()
    assert torch.equal(out, x + y)
    a = torch.randn(128, 96, device="cuda", dtype=torch.float16)
    w = torch.randn(96, 64, device="cuda", dtype=torch.float16)
    c = torch.full((128, 64), float("nan"), device="cuda")
    b.matmul[(2, 1)](a, w, c, 128, 64, 96)
    ref = a.double() @ w.double()
    assert float((c.double() - ref).norm() / ref.norm()) < 1e-3


def test_launch_on_a_side_stream(exact):
    b = warploop.load_bundle(exact)
    x = torch.randn(4096, device="cuda")
    out = torch.empty_like(x)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        b.add[(4,)](x, x, out, 4096)
    s.synchronize()
    assert torch.equal(out, 2 * x)


def test_ptx_is_jit_compiled_for_a_newer_gpu(tmp_path):
    if select_device().target.arch // 10 == 8:
        pytest.skip("an sm_80 cubin runs natively here")
    out = tmp_path / "sm80.wlb"
    build_bundle(KERNELS, ["cuda:80"], out, jobs=1, progress=False, only=["softmax"])
    b = warploop.load_bundle(out)
    assert b.chosen()["softmax"] == [{"spec": b.softmax.specs[0].label, "target": "cuda:80", "format": "ptx"}]
    x = torch.randn(3, 1000, device="cuda")
    out_t = torch.empty_like(x)
    b.softmax[(3,)](x, out_t, 1000, 1000)
    torch.cuda.synchronize()
    assert torch.allclose(out_t, torch.softmax(x, 1), atol=1e-6)


def test_host_tensor_is_refused_before_launch(exact):
    b = warploop.load_bundle(exact)
    x = torch.randn(16)
    with pytest.raises(LaunchError, match="in host memory"):
        b.add[(1,)](x, x, x, 16)


def test_loads_and_runs_with_triton_unimportable(exact):
    code = f"""
import sys
sys.modules["triton"] = None
import torch, warploop
b = warploop.load_bundle({str(exact)!r})
x = torch.randn(1000, device="cuda")
out = torch.empty_like(x)
b.add[(1,)](x, x, out, 1000)
torch.cuda.synchronize()
assert torch.equal(out, 2 * x) and sys.modules["triton"] is None
print("ok")
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.stdout.strip() == "ok", proc.stderr


def test_device_arrays_without_torch(exact):
    """The torch-free path on the GPU: DeviceArrays in, numpy out, with torch and Triton unimportable."""
    code = f"""
import sys
sys.modules["torch"] = None
sys.modules["triton"] = None
import numpy as np
import warploop
from warploop.driver import empty, from_numpy
b = warploop.load_bundle({str(exact)!r})
x, y = (np.random.default_rng(i).standard_normal(10_000).astype(np.float32) for i in (1, 2))
out = from_numpy(np.full(10_000, np.nan, np.float32))
b.add[(10,)](from_numpy(x), from_numpy(y), out, 10_000)
assert np.array_equal(out.to_numpy(), x + y)
a = np.random.default_rng(3).standard_normal((128, 96)).astype(np.float16)
w = np.random.default_rng(4).standard_normal((96, 64)).astype(np.float16)
c = from_numpy(np.full((128, 64), np.nan, np.float32))
b.matmul[(2, 1)](from_numpy(a), from_numpy(w), c, 128, 64, 96)
ref = a.astype(np.float64) @ w.astype(np.float64)
assert np.linalg.norm(c.to_numpy() - ref) / np.linalg.norm(ref) < 1e-3
print("ok")
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.stdout.strip() == "ok", proc.stderr


def test_device_arrays_mix_with_torch(exact):
    from warploop.driver import from_numpy

    b = warploop.load_bundle(exact)
    x = torch.randn(4096, device="cuda")
    xa = from_numpy(x.cpu().numpy())
    out = torch.full_like(x, float("nan"))
    b.add[(4,)](xa, x, out, 4096)
    torch.cuda.synchronize()
    assert torch.equal(out, 2 * x)
    view = torch.as_tensor(xa, device="cuda")  # __cuda_array_interface__: the same memory, no copy
    assert view.data_ptr() == xa.data_ptr() and torch.equal(view, x)
