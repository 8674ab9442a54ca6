"""Bundles as hostile input: manifests that pass the hash check but are malformed, files that are not
files, kernel names that would shadow the bundle's own attributes, and Python in the cpu variant that
a GPU-only load must never run."""
from __future__ import annotations

import argparse
import copy
import hashlib
import json
import os
import time
from pathlib import Path

import pytest

import warploop
from warploop.bundle.build import BuildError, build_bundle
from warploop.bundle.cli import main_inspect
from warploop.bundle.export import ExportSpec
from warploop.bundle.format import (
    BLOBS_START,
    FORMAT_VERSION,
    BundleFormatError,
    BundleHashError,
    Header,
    KernelEntry,
    Specialization,
    Variant,
    sha256,
    write_bundle,
)
from warploop.bundle.load import Bundle, NoVariantError
from warploop.bundle.schema import BUNDLE_ATTRIBUTES
from warploop.driver.null import NullDriver
from warploop.target import DeviceInfo, Target

H100 = DeviceInfo(Target("cuda", 90, 32), index=-1, name="null H100")
CUBIN, EVIL = b"\x7fELF not really a cubin", b"raise SystemExit(3)\n"
SPEC = ExportSpec(signature={"x": "*fp32", "n": "i32"}, constexprs={"BLOCK": 64})


def two_variant_bundle(path: Path, name: str = "add") -> Path:
    """A kernel with a cuda:90 cubin and a cpu variant whose source exits the process."""
    gpu = Variant("cuda:90", {"cubin": sha256(CUBIN)}, entry=name, arch="sm_90a")
    cpu = Variant("cpu", {"source": sha256(EVIL)}, entry=name, warp_size=1)
    entry = KernelEntry(name, ("x", "n", "BLOCK"), (Specialization(SPEC, (gpu, cpu)),))
    write_bundle(path, [entry], {"targets": ["cuda:90", "cpu"]}, {sha256(CUBIN): CUBIN, sha256(EVIL): EVIL})
    return path


def manifest_of(path: Path) -> dict:
    data = path.read_bytes()
    header = Header.parse(data)
    return json.loads(data[header.manifest_offset:header.manifest_offset + header.manifest_size])


def forge(path: Path, blobs: bytes, manifest: bytes) -> Path:
    """A file whose header and hash are right for whatever manifest bytes it is given."""
    offset = BLOBS_START + len(blobs)
    header = Header(FORMAT_VERSION, offset, len(manifest), offset + len(manifest), hashlib.sha256(manifest).digest())
    head = header.serialize()
    path.write_bytes(head + b"\0" * (BLOBS_START - len(head)) + blobs + manifest)
    return path


@pytest.fixture
def good(tmp_path) -> tuple[Path, dict, bytes]:
    path = two_variant_bundle(tmp_path / "good.wlb")
    header = Header.parse(path.read_bytes())
    return path, manifest_of(path), path.read_bytes()[BLOBS_START:header.manifest_offset]


def edited(d: dict, edit) -> bytes:
    d = copy.deepcopy(d)
    edit(d)
    return json.dumps(d).encode()


def variant0(d: dict) -> dict:
    return d["kernels"][0]["specializations"][0]["variants"][0]


MALFORMED = {   # case -> (edit of the manifest dict, or raw bytes; what the error must say)
    "missing kernels": (lambda d: d.pop("kernels"), "lacks the field.*kernels"),
    "kernels not a list": (lambda d: d.update(kernels={}), r"manifest\.kernels must be a list"),
    "variant unknown field": (lambda d: variant0(d).update(colour="red"), "unknown field.*'colour'"),
    "num_warps a string": (lambda d: variant0(d).update(num_warps="4"), r"variants\[0\]\.num_warps must be a int"),
    "bool as int": (lambda d: variant0(d).update(shared=True), r"\.shared must be a int"),
    "code in an arg name": (lambda d: d["kernels"][0].update(arg_names=["x); import os", "n", "BLOCK"]),
                            "must be a Python identifier"),
    "dunder kernel name": (lambda d: d["kernels"][0].update(name="__class__"), "must be a Python identifier"),
    "kernel named kernels": (lambda d: d["kernels"][0].update(name="kernels"), "attribute of the loaded bundle"),
    "kernel named path": (lambda d: d["kernels"][0].update(name="path"), "attribute of the loaded bundle"),
    "blob outside the file": (lambda d: next(iter(d["blobs"].values())).update(offset=1 << 40), "outside the blob"),
    "blob not in the file": (lambda d: variant0(d)["formats"].update(cubin="0" * 64), "does not contain"),
    "bad target": (lambda d: variant0(d).update(target="cuda:sm90x"), "cannot parse target"),
    "hsaco in a cuda variant": (lambda d: variant0(d)["formats"].update(hsaco=variant0(d)["formats"]["cubin"]),
                                "formats must be among cubin, ptx"),
    "signature not matching arg_names": (lambda d: d["kernels"][0].update(arg_names=["x", "BLOCK"]),
                                         "must name each of arg_names"),
    "bad type string": (lambda d: d["kernels"][0]["specializations"][0]["signature"].update(x="*fp33"), "fp33"),
    "num_warps 3": (lambda d: d["kernels"][0]["specializations"][0].update(num_warps=3), "power of two"),
    "deep nesting": (b"[" * 200_000 + b"]" * 200_000, "nests too deeply"),
    "bad UTF-8": (b'{"kernels": "\xff\xfe"}', "not UTF-8"),
    "not JSON": (b"{kernels: []}", "not JSON"),
    "a list, not an object": (b"[]", "manifest must be an object"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_manifest_is_a_format_error_in_load_and_inspect(good, tmp_path, capsys, case):
    path, manifest, blobs = good
    edit, message = MALFORMED[case]
    text = edit if isinstance(edit, bytes) else edited(manifest, edit)
    bad = forge(tmp_path / "bad.wlb", blobs, text)
    with pytest.raises(BundleFormatError, match=message) as info:
        warploop.load_bundle(bad, driver=NullDriver(H100))
    assert "rebuild it" in str(info.value)
    assert main_inspect(argparse.Namespace(bundle=str(bad), json=True)) == 1
    err = capsys.readouterr().err
    assert err.startswith("warploop bundle inspect: error: ") and err.count("\n") == 1 and "Traceback" not in err


def test_forged_file_that_is_well_formed_loads(good, tmp_path):   # forge() itself is right
    path, manifest, blobs = good
    again = forge(tmp_path / "again.wlb", blobs, json.dumps(manifest).encode())
    assert warploop.load_bundle(again, driver=NullDriver(H100)).chosen()["add"][0]["format"] == "cubin"


def test_devices_and_fifos_fail_fast(tmp_path):
    os.mkfifo(tmp_path / "fifo.wlb")
    for path in ("/dev/zero", tmp_path / "fifo.wlb", tmp_path):
        start = time.monotonic()
        with pytest.raises(BundleFormatError, match="not a regular file"):
            warploop.load_bundle(path, device="cpu")
        assert time.monotonic() - start < 1.0


def test_huge_file_is_refused_before_reading(tmp_path):
    huge = tmp_path / "huge.wlb"
    with open(huge, "wb") as f:     # sparse: nothing is written but the size
        f.truncate(9 << 30)
    with pytest.raises(BundleFormatError, match="over the"):
        warploop.load_bundle(huge, device="cpu")
    junk = tmp_path / "junk.wlb"
    with open(junk, "wb") as f:
        f.write(b"x" * 200)
        f.truncate(1 << 30)
    start = time.monotonic()
    with pytest.raises(BundleFormatError, match="not a warploop bundle"):
        warploop.load_bundle(junk, device="cpu")
    assert time.monotonic() - start < 1.0   # only the header was read


def test_header_placing_the_manifest_outside_the_file(good, tmp_path):
    path, _, _ = good
    data = bytearray(path.read_bytes())
    header = Header.parse(bytes(data))
    moved = Header(header.version, 16, header.manifest_size, header.file_size, header.manifest_sha256)
    data[:Header.LAYOUT.size] = moved.serialize()
    (tmp_path / "moved.wlb").write_bytes(bytes(data))
    with pytest.raises(BundleFormatError, match="header places"):
        warploop.load_bundle(tmp_path / "moved.wlb", device="cpu")


def test_reserved_kernel_names_are_refused_at_build(tmp_path):
    src = tmp_path / "k.py"
    src.write_text("import triton\nimport triton.language as tl\nimport warploop\n\n"
                   "@warploop.export(signature={'x': '*fp32'}, constexprs={})\n"
                   "@triton.jit\ndef kernels(x):\n    pass\n")
    with pytest.raises(BuildError, match="'kernels' is also an attribute of the loaded bundle"):
        build_bundle(src, ["cpu"], tmp_path / "k.wlb", progress=False)


def test_bundle_attributes_are_all_reserved(good):
    path, _, _ = good
    bundle = warploop.load_bundle(path, driver=NullDriver(H100), allow_python=False)
    own = {n for n in [*vars(bundle), *dir(Bundle)] if not n.startswith("_")} - set(bundle.kernels)
    assert own <= BUNDLE_ATTRIBUTES
    assert bundle.add is bundle.kernels["add"] and isinstance(bundle.kernels, dict)


def test_gpu_only_load_runs_no_python_from_the_bundle(good):
    path, _, _ = good
    bundle = warploop.load_bundle(path, driver=NullDriver(H100), allow_python=False)
    assert bundle.chosen() == {"add": [{"spec": SPEC.label(), "target": "cuda:90", "format": "cubin"}]}
    with pytest.raises(NoVariantError, match="allow_python=False forbids"):
        warploop.load_bundle(path, device="cpu", allow_python=False)
    with pytest.raises(SystemExit) as info:     # what allow_python=False prevents: the source runs at load
        warploop.load_bundle(path, device="cpu")
    assert info.value.code == 3


def test_gpu_without_its_variant_does_not_fall_back_to_python(tmp_path):
    path = two_variant_bundle(tmp_path / "b.wlb")
    hip = NullDriver(DeviceInfo(Target("hip", "gfx942", 64), index=-1, name="null MI300"))
    with pytest.raises(NoVariantError, match="allow_python=False"):
        warploop.load_bundle(path, driver=hip, allow_python=False)


def test_trusted_sha256(good, tmp_path):
    path, manifest, blobs = good
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    assert warploop.load_bundle(path, driver=NullDriver(H100), sha256=digest.upper()).add
    bad = forge(tmp_path / "bad.wlb", blobs, b"[" * 200_000)   # refused before its manifest is parsed
    with pytest.raises(BundleHashError, match=f"not the trusted {digest}"):
        warploop.load_bundle(bad, driver=NullDriver(H100), sha256=digest)


def test_inspect_says_a_bundle_is_code(tmp_path, capsys):
    path = two_variant_bundle(tmp_path / "code.wlb")
    assert main_inspect(argparse.Namespace(bundle=str(path), json=True)) == 0
    assert json.loads(capsys.readouterr().out)["python_kernels"] == ["add"]
    assert main_inspect(argparse.Namespace(bundle=str(path), json=False)) == 0
    assert "a bundle is code" in capsys.readouterr().out
