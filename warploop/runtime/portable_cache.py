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


@contextlib.contextmanager
def keyed():
    """Within: Triton's cache key is the portable one when WARPLOOP_PORTABLE_CACHE is set."""
    if not enabled():
        yield
        return
    from triton.runtime import cache
    saved = cache.triton_key
    cache.triton_key = portable_key
    try:
        yield
    finally:
        cache.triton_key = saved
