"""External handles: task handles that the host completes, so a host event can resume a continuation.

    h = wl.external(ctx)                     # a pending task slot that is never queued
    std.call_async(port, FN, x, then=std.token(h))   # any event the host will answer
    wl.then(ctx, h, on_reply, h, out)        # runs once the host completed h
    # host: rt.complete_external(h, status, result)   (the std server does this for then= tokens)

An external handle is a task id allocated like any other (so `then`, `join` and the done word
work on it unchanged) whose slot is marked with EXTERNAL_TICKET in its host-ticket word and whose
descriptor says OP_EXTERNAL. Nothing pushes it: it completes when the host posts an OP_EXTERNAL
descriptor (args: handle, status, result) through the ordinary submit ring, which the front
takes like a submission and hands to `resume_external` instead of allocating a task. So the only
device program that reads host memory is still the front, and completion runs the ordinary
`complete()`: continuations are pushed, done[slot] is published. The request takes a submit slot
but no completion record, so posting it waits only for the front, never for a task to finish.

The handle has no parent: its status (the host's, e.g. a std Status) is data for the
continuation (`wl.status(ctx, h)`), not a failure of the task that made it. Structured completion
still holds through the continuation, which is a child of the task that attached it.
"""
import triton
import triton.language as tl

from warploop.runtime import errors as E
from warploop.runtime import layout as L
from warploop.runtime.sched import complete, report_error
from warploop.runtime.sync import ARG_WORD, meta64, uload

OP_EXTERNAL = 1          # descriptor opcode of an external handle, and of the host's request completing one
EXTERNAL_TICKET = -2     # M_HOST_TICKET of an external handle (-1: not host-submitted, >= 0: a submit ticket)

_OP = tl.constexpr(OP_EXTERNAL)
_TICKET = tl.constexpr(EXTERNAL_TICKET)
_BAD_HANDLE = tl.constexpr(E.ERR_BAD_HANDLE)


@triton.jit
def _word64(words, k, index: tl.constexpr):
    lo = tl.sum(tl.where(k == index, words, 0), axis=0).to(tl.int64) & 0xFFFFFFFF
    hi = tl.sum(tl.where(k == index + 1, words, 0), axis=0).to(tl.int64)
    return lo | (hi << 32)


@triton.jit
def is_request(words, k):
    """True if a submitted descriptor (32 int32 words, k = arange(32)) asks to complete a handle."""
    return tl.sum(tl.where(k == 0, words, 0), axis=0) == _OP


@triton.jit
def resume_external(arena, words, k):
    """The front took an OP_EXTERNAL request: complete its handle with its status and result, or
    log ERR_BAD_HANDLE (not fatal) if the handle is not a pending external handle: never issued,
    an ordinary task, or completed already. The request has no completion record: the host needs
    none, and so never waits for one (host.py, complete_external)."""
    handle = _word64(words, k, ARG_WORD)
    status = tl.sum(tl.where(k == ARG_WORD + 2, words, 0), axis=0)
    result = _word64(words, k, ARG_WORD + 4)
    slot = tl.maximum(handle, 0) % tl.load(arena + L.H_POOL)
    # Pending: the slot's last issued handle, not completed. These words only grow while the slot
    # holds `handle` (done until it completes, the ticket is fixed), so uload gives every warp the
    # same answer.
    ok = (handle >= 0) & (uload(meta64(arena, L.M_ISSUED, slot)) == handle)
    ok = ok & (uload(meta64(arena, L.M_DONE, slot)) < handle)
    ok = ok & (uload(meta64(arena, L.M_HOST_TICKET, slot)) == _TICKET)
    if ok:
        tl.store(meta64(arena, L.M_RESULT, slot), result)
        complete(arena, handle, status)
    else:
        report_error(arena, _BAD_HANDLE, _OP, -1, 0, handle, 0)
