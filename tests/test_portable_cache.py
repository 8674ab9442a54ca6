"""WARPLOOP_PORTABLE_CACHE and scripts/mk_cache.py: a resident kernel compiled on a machine without
a GPU is found in Triton's cache on the GPU machine (same Triton version, another Python build)."""
import importlib.util
import io
import json
import os
import tarfile

import triton
from triton.runtime import cache

from warploop.runtime import portable_cache


def test_keyed_swaps_in_a_key_without_the_library_only_when_asked(monkeypatch):
    original = cache.triton_key
    monkeypatch.delenv(portable_cache.ENV, raising=False)
    with portable_cache.keyed():
        assert cache.triton_key is original
    monkeypatch.setenv(portable_cache.ENV, "1")
    with portable_cache.keyed():
        key = cache.triton_key()
        assert key.startswith(f"{triton.__version__}-portable-") and key != original()
    assert cache.triton_key is original       # restored
    monkeypatch.setenv(portable_cache.ENV, "0")
    assert not portable_cache.enabled()


def _mk_cache():
    path = os.path.join(os.path.dirname(__file__), "..", "scripts", "mk_cache.py")
    spec = importlib.util.spec_from_file_location("mk_cache", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_pack_rewrites_group_members_to_where_the_gpu_machine_unpacks(tmp_path):
    src = tmp_path / "cache"
    entry = src / "ABC"
    entry.mkdir(parents=True)
    (entry / "resident.cubin").write_bytes(b"\x7fELF")
    (entry / "__grp__resident.json").write_text(json.dumps(
        {"child_paths": {"resident.cubin": f"{src}/ABC/resident.cubin"}}))
    out = tmp_path / "c.tgz"
    _mk_cache().pack(str(src), str(out), "/tmp/wl-triton-cache")
    with tarfile.open(out) as tar:
        names = sorted(tar.getnames())
        group = json.load(io.TextIOWrapper(tar.extractfile("ABC/__grp__resident.json")))
        cubin = tar.extractfile("ABC/resident.cubin").read()
    assert names == ["ABC/__grp__resident.json", "ABC/resident.cubin"]
    assert group == {"child_paths": {"resident.cubin": "/tmp/wl-triton-cache/ABC/resident.cubin"}}
    assert cubin == b"\x7fELF"
