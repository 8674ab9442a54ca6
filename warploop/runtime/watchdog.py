"""A deadline for host waits that also ends a CPU-executor step stuck inside a task body.

The CPU executor runs task bodies in the calling thread, through the Triton interpreter, so a body
that loops forever never returns to the loop that checks the deadline between steps. A watchdog
thread sleeps until the deadline (plus a grace period, so a step that is about to finish is not cut
short) and then asks the interpreter bridge to raise `Interrupted` in the waiting thread at its
next Triton operation (interp.interrupt: a check at the top of every operation, so the exception
starts in plain Python, never inside the interpreter's C++ code; CPython's asynchronous exceptions
(PyThreadState_SetAsyncExc) were tried first and corrupted the heap when they landed there). Arming
and disarming cost a lock each; each interpreted operation pays one dictionary test.

The exception derives from BaseException, so the interpreter and the executor's own `except
Exception` clauses pass it through untouched. The watchdog fires at most once per arming, and
`disarm` withdraws a request not yet taken, so none can land after the wait has returned.
"""
from __future__ import annotations

import threading
import time

from warploop.runtime import interp

GRACE_S = 0.05    # past the deadline before a running step is interrupted


class Interrupted(BaseException):
    """Raised inside the waiting thread when its deadline passed during a step."""


class Watchdog:
    """One daemon thread per executor; `arm(deadline)` before a wait, `disarm()` after it."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._target: int | None = None      # thread id of the armed wait
        self._deadline = 0.0
        self._fired = False
        self._closed = False
        self._thread: threading.Thread | None = None

    def arm(self, deadline: float) -> bool:
        """Watch the calling thread until `deadline` (time.perf_counter()); False if already armed."""
        with self._cond:
            if self._target is not None:
                return False
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="warploop-watchdog", daemon=True)
                self._thread.start()
            self._target, self._deadline, self._fired = threading.get_ident(), deadline, False
            self._cond.notify()
            return True

    def disarm(self) -> None:
        with self._cond:
            if self._fired and self._target is not None:
                interp.clear_interrupt(self._target)     # withdraw it if it has not landed yet
            self._target = None
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()

    def _run(self) -> None:
        with self._cond:
            while not self._closed:
                if self._target is None or self._fired:
                    self._cond.wait()
                    continue
                left = self._deadline + GRACE_S - time.perf_counter()
                if left > 0:
                    self._cond.wait(left)
                    continue
                self._fired = True
                interp.interrupt(self._target, Interrupted)
