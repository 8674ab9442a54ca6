"""Error codes the device writes, and the exceptions the host raises for them."""
from __future__ import annotations

OK = 0
ERR_BAD_OPCODE = 1       # no task body for this opcode in the resident kernel
ERR_BAD_DESCRIPTOR = 2   # a descriptor field out of range (counter, parameter, flags)
ERR_POOL_FULL = 3        # spawn/then found no free task slot: raise Runtime(pool=...)
ERR_BAD_HANDLE = 4       # join/then on a handle that was never issued
ERR_ABORTED = 5          # the runtime was stopped while the task waited

MESSAGES = {
    ERR_BAD_OPCODE: "invalid opcode: no task body for it in this runtime",
    ERR_BAD_DESCRIPTOR: "invalid task descriptor",
    ERR_POOL_FULL: "dynamic task pool is full (raise Runtime(pool=...) or spawn fewer live tasks)",
    ERR_BAD_HANDLE: "join/then on a handle that was never issued",
    ERR_ABORTED: "stopped by the host before it completed",
}


def describe(code: int) -> str:
    return MESSAGES.get(code, f"unknown error code {code}")


class TaskError(RuntimeError):
    """A task ended with an error status (bad opcode, bad descriptor, ...)."""


class RuntimeFault(RuntimeError):
    """The runtime as a whole failed: the device reported an error, or the kernel cannot be stopped."""
