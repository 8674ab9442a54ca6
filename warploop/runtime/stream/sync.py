"""The streaming kernel's waits and clock, shared by the node kinds' bodies (Gluon).

Counters only grow: run `epoch` (0-based) of a wait on (counter, need) is met at need * (epoch + 1)
(a negative need: at -need * epoch, the run before).
A wait polls with acquire loads (the load that sees the target also orders what follows); after SPIN
polls in vain it records (1, counter, CTA, instruction) in err and stops waiting, and every later
wait of the kernel gives up at once, so the kernel always ends and the host raises with those words.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import tma

from warploop.runtime.stream.kinds import TRACE_STAMPS

TRACE_WORDS = gl.constexpr(len(TRACE_STAMPS))   # with TRACE: kinds.TRACE_STAMPS an instruction


@gluon.jit
def now():
    return gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=gl.int64, is_pure=False, pack=1)


@gluon.jit
def wait_counter(counters, err, c, target, failed, cta, i, SPIN: gl.constexpr, SCOPE: gl.constexpr):
    """Poll counter c until it reaches target (at most SPIN polls; none once a wait has failed),
    acquiring at SCOPE ("sys" where other GPUs' kernels bump it: allreduce.py). Returns `failed`."""
    cptr = counters + c
    limit = SPIN * (1 - failed)
    polls = 0
    cnt = gl.atomic_add(cptr, 0, sem="acquire", scope=SCOPE)
    while (cnt < target) & (polls < limit):
        cnt = gl.atomic_add(cptr, 0, sem="acquire", scope=SCOPE)
        polls += 1
    if cnt < target:
        failed = 1
        gl.store(err + 1, c)
        gl.store(err + 2, cta)
        gl.store(err + 3, i)
        gl.store(err + 0, 1)
    return failed


@gluon.jit
def waits(counters, err, w0, n0, w1, n1, epoch, failed, cta, i, trace, SPIN: gl.constexpr, TRACE: gl.constexpr):
    """An instruction's two header waits (a counter of -1: none), stamped before and after. A
    negative need waits on the run before: met at -need * epoch."""
    if TRACE:
        gl.store(trace + i * TRACE_WORDS, now())
    if w0 >= 0:
        failed = wait_counter(counters, err, w0, gl.abs(n0) * epoch + gl.maximum(n0, 0), failed, cta, i, SPIN, "gpu")
    if w1 >= 0:
        failed = wait_counter(counters, err, w1, gl.abs(n1) * epoch + gl.maximum(n1, 0), failed, cta, i, SPIN, "gpu")
    if TRACE:
        gl.store(trace + i * TRACE_WORDS + 1, now())
    return failed


# Triton 3.6 and 3.9 name two builtins and one method differently; these take whichever exists.
barrier = getattr(gl, "thread_barrier", None) or gl.barrier
tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
cp_async = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared   # renamed in 3.9
# 3.6 names a shared view's reinterpret _reinterpret: the kernels call .reinterpret, given under that name
# here (a jit helper taking the layout does not compile under 3.6: a layout cannot be an argument there)
if not hasattr(gl.shared_memory_descriptor, "reinterpret"):
    gl.shared_memory_descriptor.reinterpret = gl.shared_memory_descriptor._reinterpret
