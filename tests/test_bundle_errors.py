"""Every bad input of issue 2 item 6 fails before any launch, with a message that names the fix."""
from pathlib import Path

import pytest
import torch

import warploop
from warploop.bundle.args import LaunchError
from warploop.bundle.build import build_bundle
from warploop.bundle.format import FORMAT_VERSION, BundleFile, BundleFormatError, Header, Variant
from warploop.bundle.load import NoVariantError, SharedMemoryError, select_variant, shared_memory_problem
from warploop.driver.null import NullDriver
from warploop.target import CPU, DeviceInfo, Target

KERNELS = Path(__file__).resolve().parents[1] / "examples" / "kernels.py"

ALIGNED_ONLY = '''
import triton
import triton.language as tl
import warploop

@warploop.export(signature={"x": "*fp32", "n": "i32"}, constexprs={"BLOCK": 64}, specialize={"x": 16, "n": 16})
@triton.jit
def double(x, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x + offs, 2 * tl.load(x + offs, mask=offs < n), mask=offs < n)
'''


@pytest.fixture(scope="module")
def cpu_bundle(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("err") / "cpu.wlb"
    build_bundle(KERNELS, ["cpu"], out, progress=False)  # the cpu variant needs no compiler run
    return out


def damaged(src: Path, tmp_path: Path, edit) -> Path:
    data = bytearray(src.read_bytes())
    edit(data)
    out = tmp_path / "damaged.wlb"
    out.write_bytes(bytes(data))
    return out


def test_not_a_bundle(tmp_path):
    p = tmp_path / "x.wlb"
    p.write_bytes(b"PK\x03\x04 something else")
    with pytest.raises(BundleFormatError, match="not a warploop bundle.*warploop bundle build"):
        warploop.load_bundle(p, device="cpu")


def test_truncated(cpu_bundle, tmp_path):
    with pytest.raises(BundleFormatError, match="truncated.*copy it again or rebuild"):
        warploop.load_bundle(damaged(cpu_bundle, tmp_path, lambda d: d.__delitem__(slice(-100, None))), device="cpu")


def test_wrong_version(cpu_bundle, tmp_path):
    def bump(d):
        d[8:10] = (FORMAT_VERSION + 1).to_bytes(2, "little")
    with pytest.raises(BundleFormatError, match=f"format version {FORMAT_VERSION + 1}.*rebuild it"):
        warploop.load_bundle(damaged(cpu_bundle, tmp_path, bump), device="cpu")


def test_corrupted_manifest(cpu_bundle, tmp_path):
    header = Header.parse(cpu_bundle.read_bytes())

    def flip(d):
        d[header.manifest_offset + 10] ^= 0x20
    with pytest.raises(BundleFormatError, match="corrupted: its manifest does not match"):
        warploop.load_bundle(damaged(cpu_bundle, tmp_path, flip), device="cpu")


def test_corrupted_blob_is_caught_by_its_hash(cpu_bundle, tmp_path):
    blob = next(iter(BundleFile(cpu_bundle).manifest.blobs.values()))

    def flip(d):
        d[blob["offset"] + 5] ^= 0x01
    bad = damaged(cpu_bundle, tmp_path, flip)
    with pytest.raises(BundleFormatError, match=r"corrupted: the source of add for cpu does not match its SHA-256.*"
                                                r"warploop bundle build kernels.py -t cpu"):
        warploop.load_bundle(bad, device="cpu")
    with pytest.raises(BundleFormatError):
        BundleFile(bad).verify()


def test_no_variant_for_this_device_lists_contents_and_rebuild(tmp_path):
    out = tmp_path / "gpu_only.wlb"
    build_bundle(KERNELS, ["cuda:90", "hip:gfx942"], out, jobs=1, progress=False, only=["gelu"])
    with pytest.raises(NoVariantError) as e:
        warploop.load_bundle(out, device="cpu")
    msg = str(e.value)
    assert "no variant of gelu that runs on cpu (cpu)" in msg and "holds cuda:90, hip:gfx942" in msg
    assert "warploop bundle build kernels.py -t cuda:90 -t hip:gfx942 -t cpu -k gelu -o gpu_only.wlb" in msg


def v(target, arch="", formats=("cubin", "ptx")):
    return Variant(target, {f: f"hash-{target}-{f}" for f in formats}, "k", arch=arch)


SM80, SM90A, SM100A = v("cuda:80", "sm_80"), v("cuda:90", "sm_90a"), v("cuda:100", "sm_100a")
GFX942, CPU_V = v("hip:gfx942", "gfx942", ("hsaco",)), v("cpu", "", ("source",))


@pytest.mark.parametrize("device,variants,expected", [
    ("cuda:90", [SM80, SM90A, CPU_V], (SM90A, "cubin")),     # exact
    ("cuda:86", [SM80, SM90A, CPU_V], (SM80, "cubin")),      # same major, lower minor
    ("cuda:89", [SM80, CPU_V], (SM80, "cubin")),
    ("cuda:100", [SM80, SM90A, CPU_V], (SM80, "ptx")),       # never sm_90a on 10.0: JIT the sm_80 PTX
    ("cuda:103", [SM80, SM100A], (SM80, "ptx")),             # sm_100a cubin and PTX only run on 10.0
    ("cuda:120", [SM80, SM90A, SM100A], (SM80, "ptx")),
    ("cuda:75", [SM80, CPU_V], (CPU_V, "source")),           # older than every variant
    ("hip:gfx942", [SM80, GFX942, CPU_V], (GFX942, "hsaco")),
    ("hip:gfx90a", [GFX942, CPU_V], (CPU_V, "source")),      # hsaco is per-gfx
    ("cpu", [SM80, GFX942, CPU_V], (CPU_V, "source")),
    ("hip:gfx1100", [SM80, GFX942], None),
])
def test_variant_selection_rules(device, variants, expected):
    assert select_variant(variants, Target.parse(device)) == expected


def test_cpu_fallback_on_a_gpu_warns_with_the_rebuild_command(cpu_bundle):
    null = NullDriver(DeviceInfo(Target("cuda", 90, 32), index=0, name="null H100"))
    with pytest.warns(UserWarning, match="no cuda:90 variant.*-t cpu -t cuda:90"):
        b = warploop.load_bundle(cpu_bundle, driver=null)
    assert b.chosen()["add"][0]["target"] == "cpu"


def test_shared_memory_check(tmp_path):
    small = DeviceInfo(Target("cuda", 90, 32), index=-1, name="small GPU", shared_mem_optin=8 * 1024)
    big = Variant("cuda:90", {}, "matmul", shared=16384)
    why = shared_memory_problem("matmul", "BM=64", big, small)
    assert "needs 16384 bytes of shared memory per program, but small GPU (cuda:90) allows 8192" in why
    assert "smaller blocks or fewer num_stages" in why and "device='cpu'" in why
    assert shared_memory_problem("matmul", "", big, DeviceInfo(CPU)) is None
    out = tmp_path / "mm.wlb"
    build_bundle(KERNELS, ["cuda:90"], out, jobs=1, progress=False, only=["matmul"])
    null = NullDriver(small)
    with pytest.raises(SharedMemoryError, match="matmul .* needs 16384 bytes"):
        warploop.load_bundle(out, driver=null)
    assert not null.launches


def test_argument_errors(cpu_bundle):
    b = warploop.load_bundle(cpu_bundle, device="cpu")
    x = torch.randn(16)
    with pytest.raises(LaunchError, match=r"add takes 4 arguments \(x, y, out, n\), plus optionally BLOCK"):
        b.add[(1,)](x, x, x)
    with pytest.raises(LaunchError, match=r"x is int32 but the kernel was compiled for float32 \(\*fp32\)"):
        b.add[(1,)](x.int(), x, x, 16)
    with pytest.raises(LaunchError, match="y .*fp32.* needs a tensor"):
        b.add[(1,)](x, "y", x, 16)
    with pytest.raises(LaunchError, match="has no parameter BLOK; keywords it accepts: BLOCK, num_warps"):
        b.add[(1,)](x, x, x, 16, BLOK=64)
    with pytest.raises(LaunchError, match="compiled with BLOCK=1024, not 512"):
        b.add[(1,)](x, x, x, 16, BLOCK=512)


def test_misaligned_pointer_breaks_a_specialization(tmp_path):
    src = tmp_path / "aligned.py"
    src.write_text(ALIGNED_ONLY)
    out = tmp_path / "aligned.wlb"
    build_bundle(src, ["cpu"], out, progress=False)
    double = warploop.load_bundle(out, device="cpu").double
    x = torch.ones(65)
    double[(1,)](x[:64], 64)
    assert torch.equal(x[:64], torch.full((64,), 2.0))
    with pytest.raises(LaunchError, match=r"x is at 0x[0-9a-f]+, not 16-byte aligned.*specialize=\{'x': 16\}"):
        double[(1,)](x[1:], 64)
    with pytest.raises(LaunchError, match="n=60 is not a multiple of 16"):
        double[(1,)](x[:64], 60)


@pytest.mark.parametrize("kwargs,match", [
    ({"signature": {"x": "*fp32"}, "constexprs": {}}, "give a type or constexpr value for n, BLOCK"),
    ({"signature": {"x": "*fp32", "n": "i32", "BLOCK": "i32"}, "constexprs": {}}, "constexprs must be exactly"),
    ({"signature": {"x": "*fp32", "n": "i33"}, "constexprs": {"BLOCK": 4}}, "unsupported type 'i33'"),
    ({"signature": {"x": "*fp32", "n": "i32"}, "constexprs": {"BLOCK": 4}, "specialize": {"x": 12}},
     "power of two"),
    ({"signature": {"x": "*fp32", "n": "i32"}, "constexprs": {"BLOCK": 4}, "num_warps": 3}, "num_warps=3"),
])
def test_export_rejects_bad_specs(kwargs, match):
    import triton
    import triton.language as tl

    @triton.jit
    def k(x, n, BLOCK: tl.constexpr):
        pass

    with pytest.raises(ValueError, match=match):
        warploop.export(**kwargs)(k)


def test_export_requires_a_triton_kernel():
    with pytest.raises(TypeError, match="put it above @triton.jit"):
        warploop.export(signature={})(print)
