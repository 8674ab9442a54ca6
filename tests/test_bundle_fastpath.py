"""The GPU launch path, driven on a CPU through NullDriver: packing, variant choice, threads, scratch."""
import ctypes
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

import warploop
from warploop.bundle.abi import pack_bf16
from warploop.bundle.args import LaunchError
from warploop.bundle.build import build_bundle
from warploop.bundle.format import Variant
from warploop.bundle.launch import Kernel, LoadedSpec
from warploop.driver.base import DriverError
from warploop.driver.null import NullDriver
from warploop.target import DeviceInfo, Target

KERNELS = Path(__file__).resolve().parents[1] / "examples" / "kernels.py"
# index -1 is what torch reports for a CPU tensor, so CPU tensors pass the device check here
H100 = DeviceInfo(Target("cuda", 90, 32), index=-1, name="null H100", shared_mem_optin=232448)


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    out = tmp_path_factory.mktemp("fast") / "k.wlb"
    build_bundle(KERNELS, ["cuda:90", "cpu"], out, jobs=1, progress=False, only=["add", "layernorm"])
    return out


@pytest.fixture
def null():
    return NullDriver(H100)


def test_fast_path_packs_the_abi_and_picks_the_aligned_variant(path, null):
    add = warploop.load_bundle(path, driver=null).add
    aligned, plain = add.specs
    x, y, out = torch.randn(3000), torch.randn(3000), torch.zeros(3000)
    add[(3,)](x, y, out, 3000)
    launch = null.launches[-1]
    assert launch.function is aligned.handle and launch.grid == (3, 1, 1) and launch.block == 128
    assert launch.slots(6) == [x.data_ptr(), y.data_ptr(), out.data_ptr(), 3000, 0, 0]  # + 2 NULL scratch
    assert "def make_fixed" in add.fast_source
    add[(3,)](torch.randn(3001)[1:], y, out, 3000)  # x off a 16-byte boundary
    assert null.launches[-1].function is plain.handle


def test_general_path_matches_fast_path_for_other_array_types(path, null):
    add = warploop.load_bundle(path, driver=null).add
    x, y, out = torch.randn(8), torch.randn(8), torch.zeros(8)

    class CudaArray:  # anything with __cuda_array_interface__ (CuPy, Numba) takes the general path
        def __init__(self, t):
            self.__cuda_array_interface__ = {"data": (t.data_ptr(), False), "typestr": "<f4", "shape": (8,)}

    add[(1,)](CudaArray(x), CudaArray(y), CudaArray(out), 8)
    assert null.launches[-1].slots(4) == [x.data_ptr(), y.data_ptr(), out.data_ptr(), 8]
    add[lambda meta: (1,)](x, y, out, 8, stream=7)
    assert null.launches[-1].stream == 7


def test_fp32_scalars_and_bf16_packing(path, null):
    ln = warploop.load_bundle(path, driver=null).layernorm
    x, w, b, out = torch.randn(2, 10), torch.randn(10), torch.randn(10), torch.zeros(2, 10)
    ln[(2,)](x, w, b, out, 10, 10, 1e-5)
    eps_slot = null.launches[-1].slots(7)[6]
    assert ctypes.c_float.from_buffer_copy((eps_slot & 0xFFFFFFFF).to_bytes(4, "little")).value == pytest.approx(1e-5)
    for v in (1.0, -3.14159, 1e-30, 65504.0, float("inf")):
        assert pack_bf16(v) == torch.tensor(v, dtype=torch.bfloat16).view(torch.int16).item() & 0xFFFF


def test_each_thread_packs_its_own_buffer(path, null):
    add = warploop.load_bundle(path, driver=null).add
    x, y, out = torch.randn(16), torch.randn(16), torch.zeros(16)
    add[(1,)](x, y, out, 16)
    seen = []
    t = threading.Thread(target=lambda: (add[(1,)](x, y, out, 16), seen.append(null.launches[-1].slots(4))))
    t.start()
    t.join()
    assert seen == [[x.data_ptr(), y.data_ptr(), out.data_ptr(), 16]]
    assert null.launches[-1].params != null.launches[0].params


def test_driver_errors_and_empty_grids(path):
    failing = NullDriver(H100, fail_with=719)
    add = warploop.load_bundle(path, driver=failing).add
    x = torch.randn(4)
    add[(0,)](x, x, x, 4)  # nothing to launch: not an error, as in Triton
    with pytest.raises(DriverError, match="launching add .* failed: NULL_DRIVER_ERROR 719"):
        add[(1,)](x, x, x, 4)


def test_bad_arguments_through_the_fast_path(path, null):
    add = warploop.load_bundle(path, driver=null).add
    x = torch.randn(4)
    with pytest.raises(LaunchError, match="add takes 4 arguments"):
        add[(1,)](x, x, x)
    with pytest.raises(LaunchError, match="x is float16 but the kernel was compiled for float32"):
        add[(1,)](x.half(), x, x, 4)
    with pytest.raises(LaunchError, match="n=1099511627776 does not fit the kernel's i32"):
        add[(1,)](x, x, x, 2**40)
    with pytest.raises(LaunchError, match="n .i32. needs a Python int, got float"):
        add[(1,)](x, x, x, 4.0)
    with pytest.raises(LaunchError, match="grid must be 1 to 3"):
        add[(1, 1, 1, 1)]
    on_gpu0 = NullDriver(DeviceInfo(Target("cuda", 90, 32), index=0, name="null"))
    add0 = warploop.load_bundle(path, driver=on_gpu0).add
    with pytest.raises(LaunchError, match="x is in host memory but the kernel runs on cuda:0"):
        add0[(1,)](x, x, x, 4)
    assert not on_gpu0.launches


def test_scratch_and_launch_flags(null):
    from warploop.bundle.export import ExportSpec
    spec = ExportSpec({"x": "*fp32"}, {})
    variant = Variant("cuda:90", {}, "k", global_scratch_size=64, global_scratch_align=128, cooperative=True)
    loaded = LoadedSpec("k", spec, ["x"], variant, "cubin", null, "handle")
    kernel = Kernel("k", ["x"], [loaded], {}, {})
    x = torch.zeros(4)
    kernel[(4, 2)](x)
    launch = null.launches[-1]
    assert launch.flags == (1, True, False) and null.allocations == [4 * 2 * 64 + 128]
    scratch = launch.slots(3)[1]
    assert scratch % 128 == 0 and launch.slots(3)[2] == 0
    kernel[(2,)](x)  # fewer programs: the same buffer is reused
    assert len(null.allocations) == 1 and null.launches[-1].slots(2)[1] == scratch


def test_gpu_path_never_imports_triton(path):
    code = f"""
import sys
sys.modules["triton"] = None  # any import of Triton now raises
import torch, warploop
from warploop.driver.null import NullDriver
from warploop.target import DeviceInfo, Target
import warploop.driver.cuda, warploop.driver.hip
b = warploop.load_bundle({str(path)!r}, driver=NullDriver(DeviceInfo(Target("cuda", 90, 32), index=-1)))
x = torch.randn(8)
b.add[(1,)](x, x, x, 8)
b.layernorm[(1,)](x, x, x, x, 8, 8, 1e-5)
assert sys.modules["triton"] is None
print("ok")
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


