"""The driver a bundle needs: recorded per cuda variant at build, checked against the driver's CUDA
version before anything is loaded, with the PTX JIT as the fallback and an error naming the driver
and the Triton to rebuild with when neither format loads. A null driver plays each driver version."""
from __future__ import annotations

import warnings
from pathlib import Path

import pytest

import warploop
from warploop.bundle import cuda_compat
from warploop.bundle.cuda_compat import DriverTooOldError
from warploop.bundle.export import ExportSpec
from warploop.bundle.format import BundleFile, KernelEntry, Specialization, Variant, sha256, write_bundle
from warploop.driver.base import DriverError
from warploop.driver.null import NullDriver
from warploop.target import DeviceInfo, Target

CUBIN, PTX = b"\x7fELF cubin", b".version 9.1\n.target sm_90a\n"
SPEC = ExportSpec(signature={"x": "*fp32"}, constexprs={})


def bundle_with(path: Path, toolchain: dict) -> Path:
    v = Variant("cuda:90", {"cubin": sha256(CUBIN), "ptx": sha256(PTX)}, entry="k", arch="sm_90a", toolchain=toolchain)
    entry = KernelEntry("k", ("x",), (Specialization(SPEC, (v,)),))
    write_bundle(path, [entry], {"targets": ["cuda:90"], "source": "k.py", "output": path.name},
                 {sha256(CUBIN): CUBIN, sha256(PTX): PTX})
    return path


def null(driver_version: int | None, cls=NullDriver) -> NullDriver:
    return cls(DeviceInfo(Target("cuda", 90, 32), index=-1, name="null H100", driver_version=driver_version))


def loaded_format(path: Path, driver) -> str:
    return warploop.load_bundle(path, driver=driver).chosen()["k"][0]["format"]


# ptxas of CUDA 13.1 emitting PTX 9.1 (what a newer Triton might ship), and one emitting older PTX.
NEW = cuda_compat.toolchain("3.9.0", "13.1", ".version 9.1\n")
NEW_PTXAS_OLD_ISA = cuda_compat.toolchain("3.9.0", "13.1", ".version 8.7\n")


def test_toolchain_table():
    assert NEW == {"triton": "3.9.0", "ptxas": "13.1", "ptx_isa": "9.1",
                   "cubin_needs": {"cuda": "13.0", "linux_driver": "580.65.06"},
                   "ptx_needs": {"cuda": "13.1", "linux_driver": "590.44.01"}}
    triton_36 = cuda_compat.toolchain("3.6.0", "12.8", "//\n.version 8.7\n.target sm_90a\n")
    assert triton_36["cubin_needs"]["cuda"] == "12.0" and triton_36["ptx_needs"] == {"cuda": "12.8",
                                                                                     "linux_driver": "570.26"}
    assert [cuda_compat.cuda_for_ptx_isa(i) for i in ((7, 8), (8, 4), (8, 5), (8, 6), (8, 8), (9, 0))] == \
        [(11, 8), (12, 4), (12, 5), (12, 7), (12, 9), (13, 0)]
    assert cuda_compat.linux_driver((12, 7)) == "570.26"          # no 12.7: the next release's driver
    assert cuda_compat.driver_cuda(12040) == (12, 4) and cuda_compat.driver_cuda(None) is None
    no_ptxas = cuda_compat.toolchain(None, None, ".version 8.4\n")   # a Triton that hides its ptxas
    assert no_ptxas["cubin_needs"]["cuda"] == "12.0" and no_ptxas["ptx_needs"]["cuda"] == "12.4"


def test_metadata_round_trip(tmp_path):
    path = bundle_with(tmp_path / "b.wlb", NEW)
    variant = BundleFile(path).manifest.kernels[0].specializations[0].variants[0]
    assert variant.toolchain == NEW


def test_old_driver_gets_the_driver_and_triton_it_needs(tmp_path):
    path = bundle_with(tmp_path / "b.wlb", NEW)
    with pytest.raises(DriverTooOldError) as info:
        loaded_format(path, null(12040))      # a 550 driver: CUDA 12.4
    text = str(info.value)
    for needed in ("ptxas 13.1", "CUDA 13.0", "580.65.06", "supports CUDA 12.4", "PTX 9.1", "590.44.01",
                   "Triton 3.6.0 (ptxas 12.8)", "TRITON_PTXAS_PATH", "warploop bundle build k.py -t cuda:90"):
        assert needed in text, (needed, text)


def test_new_enough_driver_loads_the_cubin(tmp_path):
    path = bundle_with(tmp_path / "b.wlb", NEW)
    assert loaded_format(path, null(13000)) == "cubin"        # 580: minor version compatibility
    assert loaded_format(path, null(None)) == "cubin"         # unknown version: try, as before


def test_falls_back_to_ptx_when_the_driver_can_jit_it(tmp_path):
    path = bundle_with(tmp_path / "b.wlb", NEW_PTXAS_OLD_ISA)
    with pytest.warns(UserWarning, match="JIT-compiling its PTX"):
        assert loaded_format(path, null(12080)) == "ptx"
    with pytest.raises(DriverTooOldError, match="cannot JIT its PTX 8.7"):
        loaded_format(path, null(12040))


def test_bundles_without_the_metadata_still_load(tmp_path):
    path = bundle_with(tmp_path / "old.wlb", {})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert loaded_format(path, null(11000)) == "cubin"


class RefusesCubins(NullDriver):
    def load(self, image, fmt, entry, shared):
        if fmt == "cubin":
            raise DriverError("cuModuleLoadData(cubin) failed on null: CUDA_ERROR_NO_BINARY_FOR_GPU")
        return super().load(image, fmt, entry, shared)


def test_a_cubin_the_driver_refuses_falls_back_to_ptx(tmp_path):
    path = bundle_with(tmp_path / "b.wlb", cuda_compat.toolchain("3.6.0", "12.8", ".version 8.7\n"))
    with pytest.warns(UserWarning, match="NO_BINARY_FOR_GPU; JIT-compiling its PTX"):
        assert loaded_format(path, null(12080, RefusesCubins)) == "ptx"
    with pytest.raises(DriverError, match="NO_BINARY_FOR_GPU"):   # and PTX 8.7 is too new for 12.4
        loaded_format(path, null(12040, RefusesCubins))
