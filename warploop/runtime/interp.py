"""Run Triton kernels through the Triton interpreter in any process.

Triton decides at decoration time whether `@triton.jit` makes a compiled or an interpreted
function (TRITON_INTERPRET=1), and an interpreted kernel can only call interpreted device
functions. The CPU executor must run the same task bodies whatever the environment said when
they were defined, so while `launch` runs it routes every call of a JIT function through an
interpreted twin, or through a Python override (the CPU executor replaces the one device call
that would spin forever on a machine running one program at a time: `join`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
import threading
import types
from collections.abc import Callable

import numpy as np
import triton.language as tl
from triton.language import semantic as _semantic
from triton.runtime import interpreter
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

_lock = threading.RLock()
_twins: dict = {}
_overrides: dict = {}
_patched_fns: set = set()
_depth = 0
_orig_jit_call = JITFunction.__call__
_orig_interp_call = InterpretedFunction.__call__
_orig_patch_tensor = interpreter._patch_lang_tensor
_orig_set_attr = interpreter._LangPatchScope.set_attr
_orig_patch_lang = interpreter._patch_lang
_orig_options = None        # the interpreter builder's options while the bridge runs with its own
_touched: dict = {}      # (id(obj), name) -> (obj, name, value before the first patch)
_interrupts: dict[int, type[BaseException]] = {}   # thread id -> what it raises at its next operation
_MISSING = object()
_lang_records: dict[frozenset, list] = {}   # language modules seen by a function -> what patching them sets
_lang_now: set = set()      # those patched since the bridge was entered
_recording: list | None = None


def _set_attr(self, obj, name, value) -> None:
    # Triton patches triton.language for every interpreted device-function call and never undoes
    # those patches; remember what each attribute was so the whole bridge can be undone, and a
    # later real (compiled) kernel in the same process sees the untouched language.
    key = (id(obj), name)
    if key not in _touched:
        _touched[key] = (obj, name, getattr(obj, name, _MISSING))
    if isinstance(value, types.FunctionType):
        value = _checked(value)
    if _recording is not None:
        _recording.append((obj, name, value))
    _orig_set_attr(self, obj, name, value)


def _replay(scope, obj, name, value) -> None:
    key = (id(obj), name)
    if key not in _touched:
        _touched[key] = (obj, name, getattr(obj, name, _MISSING))
    _orig_set_attr(scope, obj, name, value)


def _pristine() -> bool:
    return all(tl.core.is_builtin(f) for f in (tl.load, tl.core.load, tl.core.tensor.__add__, tl.math.exp))


def _patch_lang(fn):
    """Triton's _patch_lang, which runs for every launch and again for every device function's first
    call in it, walks the language with inspect.getmembers each time (most of a small task's time on
    the CPU executor). The same modules patched from the untouched language always get the same
    attributes: the first time they are recorded, later launches set them again from the record, and
    a function whose modules this launch already patched patches nothing more."""
    global _recording
    key = frozenset(id(v) for v in fn.__globals__.values() if v is tl or v is tl.core)
    if key in _lang_now:
        return interpreter._LangPatchScope()
    record = _lang_records.get(key)
    if _lang_now or not _pristine():
        scope = _orig_patch_lang(fn)
    elif record is None:
        _recording = []
        try:
            scope = _orig_patch_lang(fn)
            _lang_records[key] = _recording
        finally:
            _recording = None
    else:
        scope = interpreter._LangPatchScope()
        for obj, name, value in record:
            _replay(scope, obj, name, value)
    _lang_now.add(key)
    return scope


def interrupt(thread_id: int, exc: type[BaseException]) -> None:
    """Make thread `thread_id` raise `exc` at its next Triton operation in an interpreted kernel.

    Every builtin (tl.load, tl.atomic_add, ...) and tensor method the interpreter patches checks
    first, so a body that loops forever is stopped at the top of an operation: in Python code of
    ours, never inside the interpreter's C++ (an asynchronous exception landing there can corrupt
    memory). A loop that runs no Triton operation at all is not stopped.
    """
    _interrupts[thread_id] = exc


def clear_interrupt(thread_id: int) -> None:
    _interrupts.pop(thread_id, None)


def _checked(fn):
    body, semantic = _builtin_parts(fn)
    if body is None:
        def checked(*args, **kwargs):
            if _interrupts:
                exc = _interrupts.pop(threading.get_ident(), None)
                if exc is not None:
                    raise exc
            return fn(*args, **kwargs)
        return checked

    def direct(*args, **kwargs):
        if _interrupts:
            exc = _interrupts.pop(threading.get_ident(), None)
            if exc is not None:
                raise exc
        kwargs["_semantic"] = semantic
        return body(*args, **kwargs)
    return direct


def _builtin_parts(fn):
    """(the builtin's own function, the interpreter's semantic) behind the wrapper Triton's _patch_attr
    puts on a builtin, or (None, None) where `fn` is not one such wrapper.

    Triton's wrapper (`lambda *args, member=member, **kwargs`) copies the keywords without
    `_semantic` and calls the builtin's wrapper (core.builtin) with the interpreter's semantic, which
    checks that `_semantic` was given and calls the builtin: two more Python calls and a dict for
    every operation of an interpreted kernel (a tenth of a graph step on the CPU executor). The
    direct call sets `_semantic` itself and calls the builtin."""
    member = (getattr(fn, "__kwdefaults__", None) or {}).get("member")
    if getattr(fn, "__name__", "") != "<lambda>" or member is None or not tl.core.is_builtin(member):
        return None, None
    body = getattr(member, "__wrapped__", None)
    if body is None:
        return None, None
    semantic = next((c.cell_contents for c in fn.__closure__ or ()
                     if isinstance(c.cell_contents, _semantic.TritonSemantic)), None)   # Triton 3.6
    if semantic is None and "interpreter_semantic" in fn.__code__.co_names:            # 3.7 on: a global
        semantic = getattr(interpreter, "interpreter_semantic", None)
    return (body, semantic) if semantic is not None else (None, None)


_orig_np_dtype = getattr(interpreter, "_get_np_dtype", None)
_np_dtypes: dict = {}
_U64 = np.dtype(np.uint64)


def _np_dtype(tt_dtype):
    """Triton's _get_np_dtype (the NumPy dtype of a Triton type), which builds a dict of twenty types at
    every call, a few times an operation; remembered per element type here."""
    if isinstance(tt_dtype, tl.block_type):
        tt_dtype = tt_dtype.element_ty
    if isinstance(tt_dtype, tl.pointer_type):       # unhashable; always uint64
        return _U64
    name = getattr(tt_dtype, "name", None)          # Triton's dtypes are equal when their names are
    value = _np_dtypes.get(name)
    if value is None:
        value = _orig_np_dtype(tt_dtype)
        if name is not None:
            _np_dtypes[name] = value
    return value


_orig_tensor_init = tl.core.tensor.__init__
_shapes: dict = {}


def _tensor_init(self, handle, type) -> None:
    """tl.tensor.__init__ of Triton 3.6 to 3.9 (which _TENSOR_INIT checks), with the constexprs of its
    shape and numel made once per shape: every operation of an interpreted kernel makes a tensor.
    Its shape is a tuple of triton.language's own (`tuple` in core.py), each tensor its own."""
    self.handle = handle
    if type.is_block():
        shape = type.shape      # keyed by its values: a Triton tuple's == builds tuples to compare
        key = tuple(shape.values) if shape.__class__ is _tl_tuple else tuple(shape)
    else:
        shape = key = ()
    known = _shapes.get(key)
    if known is None:
        elems = [_constexpr(s) for s in shape]
        known = _shapes[key] = (elems, _tl_tuple(elems).type, _constexpr(math.prod(shape)))
    elems, elems_type, self.numel = known
    self.type = type
    self.dtype = type.scalar
    self.shape = _tl_tuple(elems, elems_type)


_constexpr = _orig_tensor_init.__globals__.get("constexpr")
_tl_tuple = _orig_tensor_init.__globals__.get("tuple")
_orig_block_init = tl.core.block_type.__init__
_blocks: dict = {}


def _block_type_init(self, element_ty, shape) -> None:
    """tl.block_type.__init__ of Triton 3.6 to 3.9 (which _BLOCK_INIT checks) for a shape of ints or
    constexprs of ints, with what it derives from the shape (its tuple's type, numel, text) made once
    per shape; anything else, and a shape's first time (so its errors are Triton's), goes to Triton's
    own. Most operations of an interpreted kernel make a block type, and the shape's unwrapping and
    checks were a fifth of a graph step."""
    if type(shape) is list:
        dims = shape
    elif type(shape) is _tl_tuple:
        dims = shape.values
    else:
        return _orig_block_init(self, element_ty, shape)
    dims = [d.value if type(d) is _constexpr else d for d in dims]
    for d in dims:
        if type(d) is not int:
            return _orig_block_init(self, element_ty, shape)
    key = tuple(dims)
    known = _blocks.get(key)
    if known is None:
        _orig_block_init(self, element_ty, shape)
        _blocks[key] = (self.shape.type, self.numel, str(self.shape))
        return None
    elems_type, self.numel, text = known
    self.element_ty = element_ty
    self.shape = _tl_tuple(dims, elems_type)
    self.name = f"<{text}, {element_ty}>"
    return None


def _source(fn) -> str:
    try:
        return " ".join(line.split("#")[0].strip() for line in inspect.getsource(fn).splitlines()
                        if line.strip() and not line.strip().startswith(("#", '"""')))
    except (OSError, TypeError):
        return ""


# The body _tensor_init reproduces; another Triton's tensor.__init__ keeps its own.
_TENSOR_INIT = ("def __init__(self, handle, type: dtype): super().__init__() self.handle = handle "
                "self.shape = type.shape if type.is_block() else () self.numel = constexpr(math.prod(self.shape)) "
                "self.type = type self.dtype = type.scalar self.shape = tuple([constexpr(s) for s in self.shape])")
_FAST_TENSOR_INIT = (_source(_orig_tensor_init) == _TENSOR_INIT and _constexpr is tl.constexpr
                     and _tl_tuple is getattr(tl.core, "tuple", None))
_BLOCK_INIT = ("def __init__(self, element_ty: dtype, shape: List): self.element_ty = element_ty "
               "assert (isinstance(shape, (list, tuple))) self.shape = tuple(_unwrap_shape(shape)) "
               "if not self.shape: raise TypeError('0d block_type is forbidden') "
               "self.numel = validate_block_shape(self.shape) self.name = f'<{self.shape}, {self.element_ty}>'")
_FAST_BLOCK_INIT = _FAST_TENSOR_INIT and _source(_orig_block_init) == _BLOCK_INIT


def _patch_tensor(tensor, scope) -> None:
    # Triton 3.6 converts scalars with int(array_of_one); NumPy >= 2.4 refuses that, which breaks
    # `range(n)` over a scalar argument. Take the single element explicitly instead.
    _orig_patch_tensor(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))


def _int1_bitwise(orig):
    # Triton 3.9's interpreter gives `block_of_int1 & scalar_int1` an int32 handle under an int1
    # type: a load or store then refuses it as a mask ("mask has unsupported dtype"), and `~` of it
    # would be truthy both ways. Keep int1 results as numpy bools (bit 0, as the GPU keeps one bit).
    def op(self, input, other):
        ret = orig(self, input, other)
        h = ret.handle
        if isinstance(h, interpreter.TensorHandle) and ret.type.scalar == tl.int1 and h.data.dtype != np.bool_:
            ret.handle = interpreter.TensorHandle((h.data & 1).astype(np.bool_), tl.int1)
        return ret
    return op


_BITWISE = {name: getattr(_semantic.TritonSemantic, name) for name in ("and_", "or_", "xor_")
            if hasattr(getattr(_semantic, "TritonSemantic", None), name)}


def _unsanitized(options):
    """The interpreter's options without its integer overflow check, unless in debug mode. Triton checks
    every 32-bit add, sub and mul by redoing it in int64 and comparing with the bounds (six more
    operations each, a quarter of a graph step on the CPU executor), then hands the result to
    device_assert, which drops it when `debug` is off: the check changes nothing but the time."""
    return options if options.debug else dataclasses.replace(options, sanitize_overflow=False)


def _twin(raw) -> InterpretedFunction:
    fn = _twins.get(raw)
    if fn is None:
        fn = _twins[raw] = InterpretedFunction(raw)
    return fn


def _call(self, *args, **kwargs):
    override = _overrides.get(self.fn)
    if override is not None:
        return override(*args, **kwargs)
    twin = _twin(self.fn)
    if self.fn in _patched_fns:
        # Triton re-patches the language on every device-function call (and never undoes it);
        # once per function per launch is enough and makes the interpreter several times faster.
        return twin.rewrite()(*args, **kwargs)
    _patched_fns.add(self.fn)
    return _orig_interp_call(twin, *args, **kwargs)


@contextlib.contextmanager
def _patched(overrides: dict):
    global _depth, _orig_options
    with _lock:
        saved = dict(_overrides)
        _overrides.update(overrides)
        if _depth == 0:
            _orig_options = interpreter.interpreter_builder.options
            interpreter.interpreter_builder.options = _unsanitized(_orig_options)
            if _orig_np_dtype is not None:
                interpreter._get_np_dtype = _np_dtype
            if _FAST_TENSOR_INIT:
                tl.core.tensor.__init__ = _tensor_init
            if _FAST_BLOCK_INIT:
                tl.core.block_type.__init__ = _block_type_init
            JITFunction.__call__ = _call
            InterpretedFunction.__call__ = _call
            interpreter._patch_lang_tensor = _patch_tensor
            interpreter._LangPatchScope.set_attr = _set_attr
            interpreter._patch_lang = _patch_lang
            for name, orig in _BITWISE.items():
                setattr(_semantic.TritonSemantic, name, _int1_bitwise(orig))
        _depth += 1
        try:
            yield
        finally:
            _depth -= 1
            if _depth == 0:
                _patched_fns.clear()
                interpreter.interpreter_builder.options = _orig_options
                if _orig_np_dtype is not None:
                    interpreter._get_np_dtype = _orig_np_dtype
                tl.core.tensor.__init__ = _orig_tensor_init
                tl.core.block_type.__init__ = _orig_block_init
                JITFunction.__call__ = _orig_jit_call
                InterpretedFunction.__call__ = _orig_interp_call
                interpreter._patch_lang_tensor = _orig_patch_tensor
                interpreter._LangPatchScope.set_attr = _orig_set_attr
                interpreter._patch_lang = _orig_patch_lang
                for name, orig in _BITWISE.items():
                    setattr(_semantic.TritonSemantic, name, orig)
                for obj, name, original in _touched.values():
                    if original is not _MISSING:
                        setattr(obj, name, original)
                    elif name in vars(obj):
                        delattr(obj, name)
                _touched.clear()
                _lang_now.clear()
            _overrides.clear()
            _overrides.update(saved)


def scalar(x) -> int:
    """A Python int from an interpreter value (0-d tensor, numpy scalar or int)."""
    handle = getattr(x, "handle", None)
    data = getattr(handle, "data", x)
    return int(data.item() if hasattr(data, "item") else data)


def launch(kernel, grid: tuple, *args, overrides: dict[object, Callable] | None = None, **kwargs) -> None:
    """Run `kernel[grid](*args, **kwargs)` in the interpreter.

    overrides: {device function: python callable} used in place of those functions' bodies.
    Exceptions raised inside (also by overrides) come out as themselves, not wrapped.
    """
    raw = kernel.fn
    table = {getattr(f, "fn", f): impl for f, impl in (overrides or {}).items()}
    with _patched(table):
        try:
            _twin(raw)[grid](*args, **kwargs)
        except Exception as exc:  # the interpreter wraps everything in InterpreterError(repr(e))
            inner = _innermost(exc)
            raise inner from inner.__cause__


def call_original(fn, *args, **kwargs):
    """Call device function `fn` interpreted, bypassing any override (for use inside an override)."""
    return _orig_interp_call(_twin(fn.fn), *args, **kwargs)


def _innermost(exc: BaseException) -> BaseException:
    seen = exc
    while seen.__cause__ is not None and type(seen).__name__ == "InterpreterError":
        seen = seen.__cause__
    return seen
