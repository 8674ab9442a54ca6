"""Gluon kernel bodies run on the CPU: a numpy stand-in for the subset of Gluon the streaming
kernel's bodies use, so their index arithmetic, masks and control flow can be checked against the
CPU reference without a GPU (tests/test_stream_emulated.py).

Every op works on whole arrays, as one thread: layouts are ignored, barriers and mbarriers do
nothing, shared memory is a numpy array (bf16 values held as float32), a pointer is a flat buffer
with offsets, mma_v2 and warpgroup_mma are matrix products. It checks what a body computes, not its synchronisation,
its layouts or its registers: those need the GPU (tests/test_stream_gpu.py).

    body = emulated(gemv_rows.gemv_rows, waits=lambda *a: a[7], _barrier=lambda: None)
    body(S(ring), ..., P(arena_numpy), ...)
"""
from __future__ import annotations

import operator
import types

import numpy as np
import torch


def bf16(a) -> np.ndarray:
    """float32 values rounded to bfloat16 (and back), as a cast to gl.bfloat16 rounds them."""
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32)).to(torch.bfloat16).float().numpy()


F32, BF16, I32, I64, U64 = "float32", "bfloat16", "int32", "int64", "uint64"


def _a(x):
    return x.a if isinstance(x, T) else x


def _logical(name):
    return lambda x, y: (getattr(np, "logical_" + name) if np.asarray(x).dtype == bool
                         else getattr(np, "bitwise_" + name))(x, y)


def _div(x, y):   # Gluon's / on integers truncates; on floats it divides
    if np.asarray(x).dtype.kind == "f" or np.asarray(y).dtype.kind == "f":
        return np.true_divide(x, y)
    return np.trunc(np.true_divide(x, y)).astype(np.int64)


class T:
    """A tensor (or a scalar a word load gave): a numpy array and the dtype Gluon would give it."""

    __hash__ = None

    def __init__(self, a, dt=None):
        self.a = np.asarray(a)
        self.dt = dt or (F32 if self.a.dtype.kind == "f" else I64)

    def __bool__(self):
        assert self.a.size == 1, f"the truth of a {self.a.shape} tensor"
        return bool(self.a)

    def __index__(self):
        return int(self.a)

    __int__ = __index__

    def __getitem__(self, idx):
        return T(self.a[idx], self.dt)

    def __neg__(self):
        return T(-self.a)

    @property
    def shape(self):
        return self.a.shape

    @property
    def type(self):
        return types.SimpleNamespace(layout="emulated", shape=self.a.shape)

    def to(self, dt, bitcast=False):
        if isinstance(dt, tuple) and dt[0] == "pointer":   # an address (address()) made a pointer again
            return P(ADDRESSES[int(self.a)])
        if bitcast:
            return T(np.asarray(self.a, dtype=np.int32).view(np.float32))
        if dt == BF16:
            return T(bf16(self.a), BF16)
        if dt == F32:
            return T(self.a.astype(np.float32))
        if dt == U64:
            return T(self.a.astype(np.uint64), dt)
        return T(self.a.astype(np.int64), dt)


_BINARY = {"add": operator.add, "sub": operator.sub, "mul": operator.mul, "truediv": _div,
           "floordiv": operator.floordiv, "mod": operator.mod, "lt": operator.lt, "le": operator.le,
           "gt": operator.gt, "ge": operator.ge, "eq": operator.eq, "ne": operator.ne, "and": _logical("and"),
           "or": _logical("or"), "xor": _logical("xor"), "rshift": operator.rshift, "lshift": operator.lshift}
def _pair(x, y):
    """numpy operands; an unsigned side makes a non-negative signed one unsigned (Gluon's uint64
    arithmetic with int constants: numpy refuses to mix them)."""
    x, y = np.asarray(_a(x)), np.asarray(_a(y))
    for a, b in ((x, y), (y, x)):
        if a.dtype == np.uint64 and b.dtype.kind == "i":
            assert (b >= 0).all(), "a negative int meets a uint64"
    if x.dtype == np.uint64 and y.dtype.kind == "i":
        y = y.astype(np.uint64)
    elif y.dtype == np.uint64 and x.dtype.kind == "i":
        x = x.astype(np.uint64)
    return x, y


def _typed(v):
    return T(v, U64) if np.asarray(v).dtype == np.uint64 else T(v)


for _name, _op in _BINARY.items():
    setattr(T, f"__{_name}__", lambda s, o, op=_op: _typed(op(*_pair(s.a, o))))
    if _name not in ("lt", "le", "gt", "ge", "eq", "ne"):
        setattr(T, f"__r{_name}__", lambda s, o, op=_op: _typed(op(*_pair(o, s.a))))


ADDRESSES: dict[int, np.ndarray] = {}


def address(buf: np.ndarray) -> int:
    """A made-up address for `buf` (a symmetric-memory peer's arena, say): an int64 word holding it,
    loaded and cast to a pointer (.to(gl.pointer_type(...), bitcast=True)), points at `buf`."""
    at = (len(ADDRESSES) + 1) << 40
    ADDRESSES[at] = buf
    return at


class P:
    """A pointer: a flat numpy buffer and the offsets into it."""

    def __init__(self, buf: np.ndarray, off=0):
        self.buf, self.off = buf, off

    def __add__(self, o):
        return type(self)(self.buf, np.asarray(self.off) + np.asarray(_a(o)))

    __radd__ = __add__

    def to(self, dt, bitcast=False):
        """A float32 buffer's pointer as a bf16 one (each word's low half first, as on the GPU)."""
        assert bitcast and dt == ("pointer", BF16) and self.buf.dtype == np.float32, dt
        return PB(self.buf.view(np.uint16), np.asarray(self.off) * 2)


class PB(P):
    """A bf16 pointer into a float32 buffer's halves: loads give float32, stores round to bf16."""


def _masked(ptr: P, mask, *shapes):
    off = np.asarray(ptr.off)
    shape = np.broadcast_shapes(off.shape, *shapes, np.shape(_a(mask)) if mask is not None else ())
    m = np.ones(shape, bool) if mask is None else np.broadcast_to(np.asarray(_a(mask), bool), shape)
    off = np.broadcast_to(off, shape)
    assert ((off[m] >= 0) & (off[m] < ptr.buf.size)).all(), "an unmasked access outside the buffer"
    return off, m


def load(ptr: P, mask=None, other=0.0, cache_modifier=None, volatile=False):
    off, m = _masked(ptr, mask)
    v = ptr.buf[np.where(m, off, 0)]
    if isinstance(ptr, PB):
        v = (v.astype(np.uint32) << 16).view(np.float32)
        return T(np.where(m, v, np.float32(_a(other))).astype(np.float32), BF16)
    other = np.asarray(_a(other)).astype(ptr.buf.dtype)
    return T(np.where(m, v, other).astype(np.float32 if ptr.buf.dtype.kind == "f" else np.int64))


def store(ptr: P, val, mask=None):
    val = np.asarray(_a(val))
    if isinstance(ptr, PB):       # the bits of the value rounded to bf16
        val = (bf16(val).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    off, m = _masked(ptr, mask, val.shape)
    ptr.buf[off[m]] = np.broadcast_to(val, m.shape)[m]


def _atomic(update):
    def atomic(ptr: P, val, sem=None, scope=None):
        off = int(np.asarray(ptr.off))
        old = ptr.buf[off]
        ptr.buf[off] = update(old, _a(val))
        return T(np.asarray(old))
    return atomic


_BF16_SHADOWS: dict = {}      # (address, words) -> (the words, kept alive; their bf16 values)


class S:
    """A shared memory descriptor over a numpy array (bf16 values held as float32)."""

    layout = "emulated"

    def __init__(self, a: np.ndarray):
        self.a = a

    @property
    def shape(self):
        return list(self.a.shape)

    def index(self, i):
        return S(self.a[int(_a(i))])

    def slice(self, start, length, dim=0):
        idx = [slice(None)] * self.a.ndim
        idx[dim] = slice(int(_a(start)), int(_a(start)) + length)
        return S(self.a[tuple(idx)])

    def permute(self, order):
        return S(self.a.transpose(order))

    def load(self, layout):
        return T(self.a.copy(), BF16)

    def store(self, v):
        self.a[...] = np.broadcast_to(_a(v), self.a.shape)

    def _reinterpret(self, dtype, shape, layout):   # the first prod(shape) elements, as Gluon's view
        n, flat = int(np.prod(shape)), self.a.reshape(-1)
        if flat.size < n:         # bf16 over float32 words (two a word): values of their own, NaN at first,
            assert dtype == BF16 and 2 * flat.size >= n, (dtype, shape, flat.size)   # which every bf16 view
            key = (flat.__array_interface__["data"][0], flat.size)                  # of these words shares
            shadow = _BF16_SHADOWS.setdefault(key, (flat, np.full(2 * flat.size, np.nan, np.float32)))[1]
            return S(shadow[:n].reshape(shape))
        return S(flat[:n].reshape(shape))

    reinterpret = _reinterpret


def _filled(value):
    def make(shape, *args, layout=None):
        dt = args[-1] if args else F32
        v = value if value is not None else args[0]
        return T(np.full(shape, v, np.float32 if dt in (F32, BF16) else np.int64), dt)
    return make


def _layout(*args, **kwargs):
    return "emulated"


def mma_v2(a: T, b: T, acc: T) -> T:
    # [M, K] x [K, N], or batched: [B, M, K] x [B, K, N]
    assert a.shape[-1] == b.shape[-2] and acc.shape == a.shape[:-1] + b.shape[-1:], (a.shape, b.shape, acc.shape)
    return T(acc.a + a.a.astype(np.float64) @ b.a.astype(np.float64))


def warpgroup_mma(a, b, acc: T, use_acc=True, is_async=False, **options) -> T:
    # [M, K] x [K, N], each from shared memory (or a from registers)
    a, b = np.asarray(a.a), np.asarray(b.a)
    assert a.shape[-1] == b.shape[-2] and acc.shape == a.shape[:-1] + b.shape[-1:], (a.shape, b.shape, acc.shape)
    return T((acc.a if use_acc else 0) + a.astype(np.float64) @ b.astype(np.float64))


def warpgroup_mma_wait(num_outstanding=0, deps=None):
    return deps[0] if len(deps) == 1 else tuple(deps)


gl = types.SimpleNamespace(
    float32=F32, bfloat16=BF16, int32=I32, int64=I64, uint64=U64, pointer_type=lambda dt: ("pointer", dt),
    log=lambda x: T(np.log(_a(x))),
    arange=lambda lo, hi, layout=None: T(np.arange(lo, hi)),
    zeros=_filled(0.0), full=_filled(None), zeros_like=lambda t: T(np.zeros_like(t.a), t.dt),
    load=load, store=store, atomic_add=_atomic(operator.add), atomic_xchg=_atomic(lambda old, new: new),
    sum=lambda x, axis: T(np.sum(x.a, axis=axis)), max=lambda x, axis: T(np.max(x.a, axis=axis)),
    min=lambda x, axis: T(np.min(x.a, axis=axis)),
    maximum=lambda x, y: T(np.maximum(_a(x), _a(y))), minimum=lambda x, y: T(np.minimum(_a(x), _a(y))),
    where=lambda c, x, y: T(np.where(_a(c), _a(x), _a(y))), exp=lambda x: T(np.exp(_a(x))),
    rsqrt=lambda x: T(1 / np.sqrt(_a(x))), abs=lambda x: T(np.abs(_a(x))),
    convert_layout=lambda x, layout: x, static_range=range,
    inline_asm_elementwise=lambda *a, **k: T(np.int64(0)),     # timers, syncs, prefetches: nothing to emulate
    BlockedLayout=_layout, SliceLayout=_layout, NVMMADistributedLayout=_layout, DotOperandLayout=_layout,
    SwizzledSharedLayout=_layout, NVMMASharedLayout=_layout, multiple_of=lambda x, n: x,
)
mbarrier = types.SimpleNamespace(wait=lambda *a: None, arrive=lambda *a: None, expect=lambda *a: None)


def _async_copy(smem, pointer, mask=None, cache_modifier=None):   # lands at once: the waits do nothing
    smem.store(load(pointer, mask, 0.0))


async_copy = types.SimpleNamespace(async_copy_global_to_shared=_async_copy, commit_group=lambda: None,
                                   wait_group=lambda n=0: None)


def emulated(jitfn, **replaced):
    """The Python function of a Gluon jit function over the stand-ins: its module's constexprs as
    values, its jit helpers emulated too (each over its own module's globals: a helper may come from
    another module), and `replaced` (names of any of their globals) swapped in."""
    done: dict[int, types.FunctionType] = {}

    def convert(fn) -> types.FunctionType:
        if id(fn) in done:
            return done[id(fn)]
        g = dict(fn.fn.__globals__)
        done[id(fn)] = out = types.FunctionType(fn.fn.__code__, g, fn.fn.__name__, fn.fn.__defaults__)
        g.update(gl=gl, mbarrier=mbarrier, mma_v2=mma_v2, warpgroup_mma=warpgroup_mma,
                 warpgroup_mma_wait=warpgroup_mma_wait, fence_async_shared=lambda: None, now=lambda: 0,
                 async_copy=async_copy, _cp_async=_async_copy)
        for name, v in list(g.items()):
            if type(v).__name__ in ("GluonJITFunction", "JITFunction"):
                g[name] = convert(v)
            elif type(v).__name__ == "constexpr":
                g[name] = v.value
        g.update(replaced)
        return out

    return convert(jitfn)
