"""Triton's cache, fillable on a machine without a GPU (WARPLOOP_PORTABLE_CACHE=1).

Triton keys its on-disk cache on, among other things, a hash of its own compiled library
(libtriton), which differs between the wheels of one Triton version for different Python
versions. So a resident kernel compiled on a CPU-only build machine (scripts/mk_cache.py) would
never be found by the GPU machine's process, which compiles it again: minutes for a model-shaped
megakernel. With WARPLOOP_PORTABLE_CACHE=1 set on both sides, the resident kernel's compile keys
on Triton's version and the hashes of its Python sources and language files, not on the library:
the same Triton version then finds the other machine's binary. Everything else in the key (the
kernel's source, target, options, ptxas version) is unchanged.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import pkgutil

ENV = "WARPLOOP_PORTABLE_CACHE"


def enabled() -> bool:
    return os.environ.get(ENV, "") not in ("", "0")


@functools.cache
def portable_key() -> str:
    """triton_key() without the hash of libtriton: the version, then every compiler, backend and
    language source file's hash."""
    import triton
    root = os.path.dirname(os.path.abspath(triton.__file__))
    parts = []
    for sub in ("compiler", "backends", "language"):
        for lib in pkgutil.walk_packages([os.path.join(root, sub)], prefix=f"triton.{sub}."):
            with open(lib.module_finder.find_spec(lib.name).origin, "rb") as f:
                parts.append(hashlib.sha256(f.read()).hexdigest())
    with open(os.path.join(root, "runtime", "cache.py"), "rb") as f:
        parts.append(hashlib.sha256(f.read()).hexdigest())
    return f"{triton.__version__}-portable-" + hashlib.sha256("-".join(parts).encode()).hexdigest()


def _callee_first(update_hash):
    """Triton's DependenciesFinder._update_hash, computing the callee's key before it merges the
    callee's global variables. Triton 3.6 merges them first, so a callee whose key was not yet
    computed contributes none, and a function's key (and the resident kernel's, which holds every
    task) depended on what the process had compiled before: a second model shape in one process
    missed Triton's cache and compiled again, minutes for a megakernel (2026-11-27). Newer Tritons
    (3.9) compute the callee's key first; there this changes nothing (keys are memoized)."""
    @functools.wraps(update_hash)
    def wrapped(self, func):
        func.cache_key          # noqa: B018 (a property with the side effect wanted: the key and its globals)
        return update_hash(self, func)
    wrapped.warploop_callee_first = True
    return wrapped


@contextlib.contextmanager
def keyed():
    """Within: Triton's cache key of a kernel depends only on its code (not on what this process
    compiled before: _callee_first), and is the portable one when WARPLOOP_PORTABLE_CACHE is set."""
    from triton.runtime import cache, jit
    finder = jit.DependenciesFinder
    saved_update = finder._update_hash
    if not getattr(saved_update, "warploop_callee_first", False):
        finder._update_hash = _callee_first(saved_update)
    saved = cache.triton_key
    if enabled():
        cache.triton_key = portable_key
    try:
        yield
    finally:
        cache.triton_key = saved
        finder._update_hash = saved_update
