"""Arithmetic the Triton interpreter (the CPU executor) does differently from the GPU, made equal.

* fp32 -> bf16 casts: the interpreter truncates (15.231 -> 15.1875, where torch and the GPU
  round to nearest even: 15.25), so on the CPU `rnd` rounds the float32 bits itself first.
* tl.dot on bf16/fp16 operands: the interpreter holds them as raw 16-bit integers and multiplies
  those, so on the CPU `mma` raises the operands to float32 first (exact for 16-bit floats).
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rnd(x, dt: tl.constexpr, BACKEND: tl.constexpr):
    """x (float32) rounded to nearest even in dtype dt."""
    if BACKEND == "cpu":
        if dt == tl.bfloat16:
            bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            x = bits.to(tl.float32, bitcast=True)
    return x.to(dt)


@triton.jit
def mma(a, b, BACKEND: tl.constexpr):
    """tl.dot(a, b) accumulated in float32."""
    if BACKEND == "cpu":
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        out = tl.dot(a, b, input_precision="ieee")
    return out
