"""WARPLOOP_PORTABLE_CACHE and scripts/mk_cache.py: a resident kernel compiled on a machine without
a GPU is found in Triton's cache on the GPU machine (same Triton version, another Python build)."""
import importlib.util
import io
import json
import os
import subprocess
import sys
import tarfile

import triton
import triton.language as tl
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


ANSWER = tl.constexpr(42)


@triton.jit
def _leaf(x):
    return x + ANSWER


@triton.jit
def _caller(x):
    return _leaf(x)


def test_a_key_holds_its_callees_globals_whatever_was_hashed_first():
    """Triton 3.6 merged a callee's global variables into its caller's key before computing the
    callee's key, so a caller hashed first left out what its callees read (here ANSWER), and a
    kernel's key depended on the order the process hashed things in. Within keyed() the callee's
    key comes first (portable_cache._callee_first; Triton 3.9 does so itself)."""
    assert _leaf.hash is None and _caller.hash is None       # neither hashed yet: the caller goes first
    with portable_cache.keyed():
        assert _caller.cache_key
    assert "ANSWER" in {name for name, _ in _caller.used_global_vals}
    assert not getattr(triton.runtime.jit.DependenciesFinder._update_hash, "warploop_callee_first", False)


KEY_OF = """
import sys
sys.path.insert(0, {tests!r})
from mk_helpers import LLAMA_GQA, QWEN3_LIKE
from warploop.llm.mk.plans import plan_for
from warploop.llm.mk.tasks import tasks_for
from warploop.runtime import codegen
from warploop.runtime.portable_cache import keyed
from warploop.runtime.tasks import lookup
for cfg in {order}:
    module = codegen.build([lookup(t) for t in tasks_for(plan_for(cfg, "bfloat16", 16, "cuda")).all])
    with keyed():
        key = module.resident.cache_key
print(key)
"""


def test_resident_kernel_key_does_not_depend_on_what_the_process_compiled_before():
    """The same model shape's resident kernel has one cache key, whether or not another shape was
    hashed first in the process (else a second model in one process compiles again: minutes)."""
    tests = os.path.dirname(os.path.abspath(__file__))

    def key(order: str) -> str:
        out = subprocess.run([sys.executable, "-c", KEY_OF.format(tests=tests, order=order)], capture_output=True,
                             text=True, timeout=300, check=True)
        return out.stdout.split()[-1]

    assert key("[LLAMA_GQA]") == key("[QWEN3_LIKE, LLAMA_GQA]")


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
