"""DeviceArray (GPU memory without torch) and the torch-free launch path, driven on a CPU by NullDriver."""
import gc
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import warploop
from warploop.bundle.args import LaunchError
from warploop.bundle.build import build_bundle
from warploop.driver import DeviceArray, empty, from_numpy
from warploop.driver.null import NullDriver
from warploop.target import DeviceInfo, Target

KERNELS = Path(__file__).resolve().parents[1] / "examples" / "kernels.py"
# index -1 is what torch reports for a CPU tensor, so CPU tensors pass the device check here too
H100 = DeviceInfo(Target("cuda", 90, 32), index=-1, name="null H100", shared_mem_optin=232448)


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    out = tmp_path_factory.mktemp("array") / "k.wlb"
    build_bundle(KERNELS, ["cuda:90", "cpu"], out, jobs=1, progress=False, only=["add", "layernorm", "silu_mul"])
    return out


@pytest.fixture
def null():
    return NullDriver(H100)


def test_round_trips_through_device_memory(null):
    rng = np.random.default_rng(0)
    for dtype in (np.float32, np.float16, np.int64, np.uint8):
        host = (rng.standard_normal((3, 5)) * 100).astype(dtype)
        a = from_numpy(host, driver=null)
        assert a.shape == (3, 5) and a.dtype == np.dtype(dtype).name and a.nbytes == host.nbytes
        assert np.array_equal(a.to_numpy(), host) and a.to_numpy().dtype == dtype
    values = np.array([1.0, -3.14159, 1e-30, 65504.0, np.inf, np.nan, 2.0 ** -130], np.float32)
    b = from_numpy(values, "bfloat16", driver=null)
    expected = torch.from_numpy(values).to(torch.bfloat16).float().numpy()  # torch rounds to nearest even too
    assert np.array_equal(b.to_numpy(), expected, equal_nan=True) and b.nbytes == 2 * values.size
    e = empty((2, 4), "int32", driver=null)
    e.copy_from_numpy(np.arange(8))
    assert e.to_numpy().tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert e.__cuda_array_interface__ == {"shape": (2, 4), "typestr": "<i4", "data": (e.data_ptr(), False),
                                          "strides": None, "version": 3}
    assert not hasattr(b, "__cuda_array_interface__")  # no typestr for bfloat16


def test_memory_is_freed_with_the_array(null):
    a = empty(1000, driver=null)
    address = a.data_ptr()
    del a
    gc.collect()
    assert null.freed == [address]


def test_bad_arrays_say_what_to_do(null):
    with pytest.raises(ValueError, match="does not hold 'float8_e4m3fn'; use one of bool, int8"):
        empty(4, "float8_e4m3fn", driver=null)
    with pytest.raises(ValueError, match="non-negative sizes"):
        empty((2, -1), driver=null)
    with pytest.raises(ValueError, match="cannot copy 3 elements into a DeviceArray of shape \\(4,\\)"):
        empty(4, driver=null).copy_from_numpy(np.zeros(3))
    with pytest.raises(ValueError, match="DeviceArray needs a GPU.*pass numpy arrays or torch tensors"):
        empty(4, device="cpu")


def test_launch_packs_array_addresses_on_the_fast_path(path, null):
    b = warploop.load_bundle(path, driver=null)
    x, y, out = (from_numpy(np.full(3000, v, np.float32), driver=null) for v in (1.0, 2.0, np.nan))
    b.add[(3,)](x, y, out, 3000)
    launch = null.launches[-1]
    assert launch.function is b.add.specs[0].handle  # the 16-byte aligned specialization
    assert launch.slots(6) == [x.data_ptr(), y.data_ptr(), out.data_ptr(), 3000, 0, 0]
    assert "type(a0) is ARRAY" in b.add.fast_source
    t = torch.zeros(3000)
    b.add[(3,)](x, t, out, 3000)  # mixed with a torch tensor: the data_ptr() route
    assert null.launches[-1].slots(3) == [x.data_ptr(), t.data_ptr(), out.data_ptr()]
    g, u, o = (from_numpy(np.ones(8, np.float32), "bfloat16", driver=null) for _ in range(3))
    b.silu_mul[(1,)](g, u, o, 8)
    assert null.launches[-1].slots(4) == [g.data_ptr(), u.data_ptr(), o.data_ptr(), 8]


def test_array_errors_match_tensor_errors(path, null):
    b = warploop.load_bundle(path, driver=null)
    x = from_numpy(np.ones(4, np.float32), driver=null)
    with pytest.raises(LaunchError, match=r"x is int32 but the kernel was compiled for float32 \(\*fp32\)"):
        b.add[(1,)](empty(4, "int32", driver=null), x, x, 4)
    elsewhere = NullDriver(DeviceInfo(Target("cuda", 90, 32), index=1, name="null 1"))
    with pytest.raises(LaunchError, match="y is on device 1 but the kernel was loaded for cuda:-1; move it there"):
        b.add[(1,)](x, empty(4, driver=elsewhere), x, 4)
    with pytest.raises(LaunchError, match="add takes 4 arguments"):
        b.add[(1,)](x, x, x)
    assert not null.launches


def test_fast_path_is_remade_when_torch_arrives(path, null, monkeypatch):
    b = warploop.load_bundle(path, driver=null)
    x = from_numpy(np.ones(16, np.float32), driver=null)
    with monkeypatch.context() as m:
        m.setitem(sys.modules, "torch", None)  # as if torch were never imported
        b.add[(1,)](x, x, x, 16)
    assert "DT0_0" in b.add.fast_source and b.add._made_without_torch
    t = torch.ones(16)
    b.add[(1,)](t, t, t, 16)  # torch.float32 is not bound yet: the general path launches and resets
    assert not b.add._made_without_torch and len(null.launches) == 2
    general_calls = []
    real_general = b.add.general
    b.add.general = lambda *a, **k: (general_calls.append(a), real_general(*a, **k))
    b.add[(1,)](t, t, t, 16)
    assert general_calls == [] and null.launches[-1].slots(1) == [t.data_ptr()]


def test_torch_free_process_loads_and_launches(path):
    code = f"""
import sys
sys.modules["torch"] = None  # any import of torch or Triton now raises
sys.modules["triton"] = None
import numpy as np
import warploop
from warploop.driver import from_numpy, empty
from warploop.driver.null import NullDriver
from warploop.target import DeviceInfo, Target
null = NullDriver(DeviceInfo(Target("cuda", 90, 32), index=0, name="null"))
b = warploop.load_bundle({str(path)!r}, driver=null)
x = from_numpy(np.arange(8, dtype=np.float32), driver=null)
out = empty(8, driver=null)
b.add[(1,)](x, x, out, 8)
b.add[lambda meta: (1,)](x, x, out, 8, stream=5)  # the general path, too
b.layernorm[(1,)](x, x, x, out, 8, 8, 1e-5)
assert [launch.slots(1)[0] for launch in null.launches] == [x.data_ptr()] * 3
assert null.launches[1].stream == 5 and null.launches[0].stream is None
assert sys.modules["torch"] is None and sys.modules["triton"] is None
print("ok", isinstance(out, warploop.driver.DeviceArray))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok True", proc.stderr


def test_device_array_is_exported_lazily():
    code = "import sys, warploop.driver; assert 'numpy' not in sys.modules; warploop.driver.DeviceArray; print('ok')"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.stdout.strip() == "ok", proc.stderr
    assert DeviceArray.__module__ == "warploop.driver.array"
