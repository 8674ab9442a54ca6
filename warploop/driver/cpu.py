"""The CPU executor: runs a bundle's kernels through the Triton interpreter, where no GPU exists.

A cpu variant carries the source file that defined its kernel. It is executed here as a fresh module
with Triton's interpreter switched on, so `@triton.jit` yields interpreted functions; its text is
registered with `linecache` because the interpreter re-parses kernel source through `inspect`.
Programs run one after another, so kernels that wait on another program cannot run here.
"""
from __future__ import annotations

import contextlib
import hashlib
import linecache
import sys
import threading
import types
from collections.abc import Iterator
from typing import Any

from warploop.driver.base import Driver, DriverError


class CpuDriver(Driver):
    backend = "cpu"

    _modules: dict[str, types.ModuleType] = {}  # shared by all CPU drivers: one module per source text

    def load(self, image: bytes, fmt: str, entry: str, shared: int) -> Any:
        if fmt != "source":
            raise DriverError(f"the CPU executor runs kernel source, not {fmt}")
        module = self._module(image)
        kernel = module.__dict__.get(entry)
        if kernel is None or not hasattr(kernel, "run"):
            raise DriverError(f"the bundle's source does not define a Triton kernel named {entry!r}")
        return kernel

    def _module(self, source: bytes) -> types.ModuleType:
        digest = hashlib.sha256(source).hexdigest()[:16]
        module = self._modules.get(digest)
        if module is not None:
            return module
        from triton import knobs

        name = f"warploop_cpu_{digest}"
        filename = f"<warploop bundle source {digest}>"
        text = source.decode()
        linecache.cache[filename] = (len(text), None, text.splitlines(keepends=True), filename)
        module = types.ModuleType(name)
        module.__file__ = filename
        sys.modules[name] = module
        try:
            with knobs.runtime.scope():
                knobs.runtime.interpret = True
                exec(compile(text, filename, "exec"), module.__dict__)
        except Exception as e:
            del sys.modules[name]
            raise DriverError(f"the bundle's kernel source failed to run on the CPU executor: "
                              f"{type(e).__name__}: {e} (does it import modules that are not installed here?)") from e
        self._modules[digest] = module
        return module

    def run(self, kernel: Any, grid: tuple[int, int, int], args: dict[str, Any]) -> None:
        """Run every program of `grid`, one after another; `args` holds every parameter (constexprs too),
        by name. Tensors may live on any torch device: the interpreter copies them to the host and back."""
        with _RUN_LOCK, _interpreted_language():
            kernel[grid](**args)


_RUN_LOCK = threading.Lock()  # the interpreter patches triton.language globally while it runs
_TWINS: dict[int, Any] = {}


@contextlib.contextmanager
def _interpreted_language() -> Iterator[None]:
    """Run kernels as Triton's interpreter expects, and leave triton.language as it was found.

    Under TRITON_INTERPRET=1 Triton's own @jit library functions (tl.sum, tl.sigmoid, x.max(), ...)
    are interpreted from import on; a bundle runs in a process where Triton may have been imported
    without it, so they are swapped for interpreted twins here. The interpreter also patches
    triton.language while it runs, and a nested call of an interpreted function never undoes its
    patches (Triton 3.6); left in place they break Triton's JIT compiler later in the same process.
    So every attribute of every object that may be touched is snapshotted and restored."""
    import triton.language as tl
    from triton.runtime import interpreter
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    with contextlib.suppress(ImportError):  # imported lazily by the interpreter; it must see the originals
        import triton.experimental.gluon  # noqa: F401

    modules = [m for name, m in list(sys.modules.items()) if name.startswith("triton.language") and m is not None]
    touched = [*modules, interpreter, tl.core.tensor, tl.core.dtype, tl.core.tensor_descriptor_base]
    snapshot = [(obj, dict(vars(obj))) for obj in touched]
    original_patch = interpreter._patch_lang_tensor

    def patch_tensor(tensor: Any, scope: Any) -> None:
        # Triton 3.6 turns scalars into 1-element arrays and reads them with int(array), which NumPy 2.3+
        # refuses: `for k in range(0, K, BK)` over a runtime K fails. Read the one element instead.
        original_patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    try:
        for owner in [*modules, tl.core.tensor]:
            for name, value in list(vars(owner).items()):
                if isinstance(value, JITFunction):
                    twin = _TWINS.get(id(value))
                    if twin is None:
                        twin = _TWINS[id(value)] = InterpretedFunction(value.fn)
                    setattr(owner, name, twin)
        interpreter._patch_lang_tensor = patch_tensor
        yield
    finally:
        for obj, before in snapshot:
            now = vars(obj)
            # Names the interpreter adds to a module (its rewritten functions' globals) stay: cached
            # rewrites need them and the compiler never looks them up. Names added to a class go.
            for name in [n for n in now if n not in before] if isinstance(obj, type) else []:
                delattr(obj, name)
            for name, value in before.items():
                if now.get(name, _ABSENT) is not value:
                    setattr(obj, name, value)


_ABSENT = object()
