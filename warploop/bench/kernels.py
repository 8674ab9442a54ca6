"""Twelve small Triton kernels exported for bundling: `warploop bundle build examples/kernels.py ...`.

Each is an ordinary Triton kernel (it still runs under Triton's JIT); `@warploop.export` records the
signature and constexpr values to compile it with ahead of time. The file ships inside the package
(examples/kernels.py links here) so `warploop bench bundle` works from any install; the bench checks
every kernel against float64 references (its cases live in bundle_child.py, which must not import Triton).
It is compiled from its path, never imported as warploop.bench.kernels: a bundle's cpu variant is this
file's text, so it must stand alone.
"""
import triton
import triton.language as tl

import warploop

VEC = {"x": "*fp32", "y": "*fp32", "out": "*fp32", "n": "i32"}


# The first export written is the default; the second promises 16-byte aligned pointers, so Triton
# can use 128-bit loads. A launch takes the aligned one whenever the tensors allow it.
@warploop.export(signature=VEC, constexprs={"BLOCK": 1024})
@warploop.export(signature=VEC, constexprs={"BLOCK": 1024}, specialize={"x": 16, "y": 16, "out": 16})
@triton.jit
def add(x, y, out, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out + offs, tl.load(x + offs, mask=mask) + tl.load(y + offs, mask=mask), mask=mask)


@warploop.export(signature={"alpha": "fp32", "x": "*fp32", "y": "*fp32", "n": "i32"}, constexprs={"BLOCK": 1024})
@triton.jit
def axpy(alpha, x, y, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(y + offs, alpha * tl.load(x + offs, mask=mask) + tl.load(y + offs, mask=mask), mask=mask)


@warploop.export(signature={"x": "*fp32", "out": "*fp32", "n": "i32"}, constexprs={"BLOCK": 1024})
@triton.jit
def gelu(x, out, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    v = tl.load(x + offs, mask=mask)
    tl.store(out + offs, 0.5 * v * (1.0 + tl.math.erf(v * 0.7071067811865476)), mask=mask)


@warploop.export(signature={"gate": "*bf16", "up": "*bf16", "out": "*bf16", "n": "i32"}, constexprs={"BLOCK": 1024})
@triton.jit
def silu_mul(gate, up, out, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(gate + offs, mask=mask).to(tl.float32)
    u = tl.load(up + offs, mask=mask).to(tl.float32)
    tl.store(out + offs, (g * tl.sigmoid(g) * u).to(tl.bfloat16), mask=mask)


@warploop.export(signature={"x": "*fp32", "out": "*fp32", "n": "i32"}, constexprs={"BLOCK": 1024})
@triton.jit
def reduce_sum(x, out, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.atomic_add(out, tl.sum(tl.load(x + offs, mask=offs < n, other=0.0), axis=0))


ROW = {"x": "*fp32", "out": "*fp32", "n_cols": "i32", "stride": "i32"}


@warploop.export(signature=ROW, constexprs={"BLOCK": 1024})
@triton.jit
def softmax(x, out, n_cols, stride, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    v = tl.load(x + row * stride + cols, mask=cols < n_cols, other=-float("inf"))
    e = tl.exp(v - tl.max(v, axis=0))
    tl.store(out + row * stride + cols, e / tl.sum(e, axis=0), mask=cols < n_cols)


@warploop.export(signature=ROW, constexprs={"BLOCK": 1024})
@triton.jit
def cumsum(x, out, n_cols, stride, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    v = tl.load(x + row * stride + cols, mask=cols < n_cols, other=0.0)
    tl.store(out + row * stride + cols, tl.cumsum(v, axis=0), mask=cols < n_cols)


@warploop.export(signature={"x": "*fp32", "w": "*fp32", "b": "*fp32", "out": "*fp32", "n_cols": "i32",
                            "stride": "i32", "eps": "fp32"}, constexprs={"BLOCK": 1024})
@triton.jit
def layernorm(x, w, b, out, n_cols, stride, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    v = tl.load(x + row * stride + cols, mask=mask, other=0.0)
    mean = tl.sum(v, axis=0) / n_cols
    d = tl.where(mask, v - mean, 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(d * d, axis=0) / n_cols + eps)
    y = d * rstd * tl.load(w + cols, mask=mask) + tl.load(b + cols, mask=mask)
    tl.store(out + row * stride + cols, y, mask=mask)


@warploop.export(signature={"x": "*fp32", "w": "*fp32", "out": "*fp32", "n_cols": "i32", "stride": "i32",
                            "eps": "fp32"}, constexprs={"BLOCK": 1024})
@triton.jit
def rmsnorm(x, w, out, n_cols, stride, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    v = tl.load(x + row * stride + cols, mask=mask, other=0.0)
    rms = tl.sqrt(tl.sum(v * v, axis=0) / n_cols + eps)
    tl.store(out + row * stride + cols, v / rms * tl.load(w + cols, mask=mask), mask=mask)


@warploop.export(signature={"ids": "*i64", "table": "*fp32", "out": "*fp32", "dim": "i32"}, constexprs={"BLOCK": 256})
@triton.jit
def embedding(ids, table, out, dim, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    row = tl.load(ids + i)
    cols = tl.arange(0, BLOCK)
    tl.store(out + i * dim + cols, tl.load(table + row * dim + cols, mask=cols < dim), mask=cols < dim)


@warploop.export(signature={"x": "*fp32", "out": "*fp32", "M": "i32", "N": "i32"}, constexprs={"BM": 32, "BN": 32})
@triton.jit
def transpose(x, out, M, N, BM: tl.constexpr, BN: tl.constexpr):
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    tile = tl.load(x + rm[:, None] * N + rn[None, :], mask=mask)
    tl.store(out + rn[None, :] * M + rm[:, None], tile, mask=mask)


MATMUL = {"a": "*fp16", "b": "*fp16", "c": "*fp32", "M": "i32", "N": "i32", "K": "i32"}


@warploop.export(signature=MATMUL, constexprs={"BM": 64, "BN": 64, "BK": 32}, num_warps=4, num_stages=3)
@triton.jit
def matmul(a, b, c, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """c[M, N] = a[M, K] @ b[K, N], all row-major; fp16 inputs, fp32 accumulation and output."""
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        ka = k0 + rk
        ta = tl.load(a + rm[:, None] * K + ka[None, :], mask=(rm[:, None] < M) & (ka[None, :] < K), other=0.0)
        tb = tl.load(b + ka[:, None] * N + rn[None, :], mask=(ka[:, None] < K) & (rn[None, :] < N), other=0.0)
        acc = tl.dot(ta, tb, acc)
    tl.store(c + rm[:, None] * N + rn[None, :], acc, mask=(rm[:, None] < M) & (rn[None, :] < N))
