"""Compile-only tests: every build target from a CPU-only machine, the manifest, and `bundle inspect`."""
import importlib.metadata
import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from warploop.bundle.build import BUILD_TARGETS, BuildError, build_bundle
from warploop.bundle.format import BundleFile

KERNELS = Path(__file__).resolve().parents[1] / "examples" / "kernels.py"
SMALL = ["add", "softmax", "matmul"]
# EF_AMDGPU_MACH_* in the low byte of an AMDGPU ELF's e_flags (LLVM's AMDGPUUsage): the code object's GPU.
# Read from the header rather than searched for as a string: newer Triton no longer embeds the triple's text.
AMDGPU_MACH = {"gfx90a": 0x3F, "gfx942": 0x4C, "gfx1100": 0x41}


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> BundleFile:
    out = tmp_path_factory.mktemp("build") / "small.wlb"
    build_bundle(KERNELS, list(BUILD_TARGETS), out, jobs=2, progress=False, only=SMALL)
    return BundleFile(out)


def variant(bundle, kernel, target, spec=0):
    entry = next(k for k in bundle.manifest.kernels if k.name == kernel)
    return next(v for v in entry.specializations[spec].variants if v.target == target)


@pytest.mark.parametrize("target,ptx_target", [("cuda:80", "sm_80"), ("cuda:90", "sm_90a"), ("cuda:100", "sm_100a")])
def test_nvidia_variants_carry_cubin_and_ptx_for_their_arch(bundle, target, ptx_target):
    for kernel in SMALL:
        v = variant(bundle, kernel, target)
        ptx = bundle.blob(v.formats["ptx"]).decode()
        assert f".target {ptx_target}" in ptx
        assert f".entry {v.entry}(" in ptx
        assert bundle.blob(v.formats["cubin"])[:4] == b"\x7fELF"
        assert v.arch == ptx_target and v.arch_specific == ptx_target.endswith("a")


@pytest.mark.parametrize("gfx", ["gfx90a", "gfx942", "gfx1100"])
def test_amd_variants_carry_hsaco_for_their_gfx(bundle, gfx):
    for kernel in SMALL:
        v = variant(bundle, kernel, f"hip:{gfx}")
        hsaco = bundle.blob(v.formats["hsaco"])
        assert hsaco[:4] == b"\x7fELF"
        assert hsaco[18] == 224  # e_machine: EM_AMDGPU
        assert struct.unpack_from("<I", hsaco, 48)[0] & 0xFF == AMDGPU_MACH[gfx]
        assert v.warp_size == (64 if gfx.startswith("gfx9") else 32)


def test_cpu_variant_is_the_source_file(bundle):
    v = variant(bundle, "add", "cpu")
    assert bundle.blob(v.formats["source"]) == KERNELS.read_bytes()
    assert v.entry == "add"


def test_manifest_records_launch_metadata(bundle):
    m = bundle.manifest
    assert m.build["targets"] == list(BUILD_TARGETS)
    assert m.build["versions"]["triton"] == importlib.metadata.version("triton")
    mm = variant(bundle, "matmul", "cuda:90")
    assert mm.num_warps == 4 and mm.num_ctas == 1 and mm.shared > 0
    assert mm.global_scratch_size == 0 and mm.profile_scratch_size == 0 and not mm.cooperative
    add = next(k for k in m.kernels if k.name == "add")
    assert add.arg_names == ("x", "y", "out", "n", "BLOCK")
    written_first, aligned = add.specializations
    assert written_first.spec.specialize == {} and aligned.spec.specialize == {"x": 16, "y": 16, "out": 16}
    layout = add.to_dict()["specializations"][0]["param_layout"]
    assert [p["name"] for p in layout] == ["x", "y", "out", "n", "global_scratch", "profile_scratch"]
    assert [p["offset"] for p in layout] == [0, 8, 16, 24, 32, 40]
    # identical blobs (the cpu source) are stored once
    assert len(m.blobs) == len({d for k in m.kernels for s in k.specializations for v in s.variants
                                for d in v.formats.values()})


def test_inspect_json_contract(bundle):
    out = subprocess.run([sys.executable, "-m", "warploop.cli", "bundle", "inspect", bundle.path, "--json"],
                         capture_output=True, text=True, check=True).stdout
    data = json.loads(out)
    assert [k["name"] for k in data["kernels"]] == SMALL
    by_target = {v["target"]: v["formats"] for v in data["kernels"][0]["variants"]}
    assert by_target["cuda:90"] == ["cubin", "ptx"] and by_target["hip:gfx942"] == ["hsaco"]
    assert by_target["cpu"] == ["source"] and list(by_target) == list(BUILD_TARGETS)
    assert data["verified"] is True


def test_build_cli_reports_progress_and_rejects_unknown_kernels(tmp_path):
    out = tmp_path / "one.wlb"
    cmd = [sys.executable, "-m", "warploop.cli", "bundle", "build", str(KERNELS), "-t", "cuda:80", "-t", "cpu",
           "-k", "gelu", "-o", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    # stderr is a pipe here, not a terminal: one line says what is compiled, and no progress bar is drawn
    assert "compiling 1 GPU variants" in proc.stderr and "1/1" not in proc.stderr and "\r" not in proc.stderr
    assert [k.name for k in BundleFile(out).manifest.kernels] == ["gelu"]
    bad = subprocess.run(cmd[:-2] + ["-k", "nope", "-o", str(out)], capture_output=True, text=True)
    assert bad.returncode == 1 and "exports no kernel nope" in bad.stderr


def test_build_errors_name_the_fix(tmp_path):
    empty = tmp_path / "empty.py"
    empty.write_text("x = 1\n")
    with pytest.raises(BuildError, match="exports no kernels"):
        build_bundle(empty, ["cpu"], tmp_path / "e.wlb")
    with pytest.raises(ValueError, match="cannot parse target"):
        build_bundle(KERNELS, ["cuda:sm90x"], tmp_path / "e.wlb")
    broken = tmp_path / "broken.py"
    broken.write_text(BROKEN)
    with pytest.raises(BuildError, match=r"compiling bad \[.*\] for cuda:80 failed"):
        build_bundle(broken, ["cuda:80"], tmp_path / "b.wlb", jobs=1, progress=False)


BROKEN = '''
import triton
import triton.language as tl
import warploop

@warploop.export(signature={"x": "*fp32"}, constexprs={"B": 100})
@triton.jit
def bad(x, B: tl.constexpr):
    tl.store(x + tl.arange(0, B), 1.0)  # arange needs a power of two
'''


@pytest.mark.parametrize("target", ["cuda:80", "cuda:90", "cuda:100"])
def test_nvidia_variants_record_the_driver_they_need(bundle, target):
    import re

    import triton
    from triton.backends.nvidia.compiler import get_ptxas

    from warploop.bundle import cuda_compat

    v = variant(bundle, "add", target)
    isa = re.search(r"^\.version (\d+\.\d+)", bundle.blob(v.formats["ptx"]).decode(), re.M).group(1)
    tc = v.toolchain
    assert (tc["triton"], tc["ptxas"], tc["ptx_isa"]) == (triton.__version__, get_ptxas(int(target[5:])).version, isa)
    assert tc["cubin_needs"]["cuda"] == tc["ptxas"].split(".")[0] + ".0"
    assert cuda_compat.parse(tc["ptx_needs"]["cuda"]) == cuda_compat.cuda_for_ptx_isa(cuda_compat.parse(isa))
    assert tc["ptx_needs"]["linux_driver"] == cuda_compat.linux_driver(cuda_compat.parse(tc["ptx_needs"]["cuda"]))
    assert variant(bundle, "add", "hip:gfx942").toolchain == {} == variant(bundle, "add", "cpu").toolchain


def test_builds_spell_out_fp_fusion(tmp_path):
    """A bundle's kernels are compiled with FP fusion asked for by name, not by Triton's default
    (3.9 warns that 3.10 turns the default off, which would change a bundle's numbers): in a fresh
    process with the default unset and warnings as errors, a build succeeds."""
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_DEFAULT_FP_FUSION"}
    code = ("import sys; from warploop.bundle.build import build_bundle; "
            f"build_bundle({str(KERNELS)!r}, ['cuda:90'], {str(tmp_path / 'f.wlb')!r}, jobs=1, progress=False, "
            "only=['add'])")
    r = subprocess.run([sys.executable, "-W", "error::UserWarning", "-c", code], capture_output=True, text=True,
                       env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
