"""Rendering a model's chat template: Jinja's immutable sandbox, as transformers renders it, plus
bounds on work, output and time.

A chat template is code that came with the model directory. The sandbox keeps it from reaching
Python internals; the bounds keep one template (or one request feeding it) from taking the server
down: every `range` draws from a per-render budget, `*` and `**` may not build huge values, the
output is capped, and a watchdog stops a render past its deadline, whatever it loops over. Any
failure, a Python one included (ZeroDivisionError, RecursionError), becomes one ChatTemplateError.

Not bounded: memory a template builds by repeated `~` concatenation within the deadline (a
doubling string reaches gigabytes in about 30 steps); the template is the model's, so a model
directory from an untrusted source is still untrusted code.
"""
from __future__ import annotations

import ctypes
import datetime
import functools
import json
import threading
import time

MAX_RANGE_STEPS = 1_000_000      # `range` items a render may iterate over, all loops together
MAX_OUTPUT_CHARS = 16 << 20      # rendered text; far beyond any context, far below the memory
MAX_SECONDS = 5.0                # wall time of one render
MAX_POWER_EXPONENT = 64          # `x ** n` beyond this is a resource attack, not a chat format


class ChatTemplateError(ValueError):
    """The chat template failed or exceeded its bounds while rendering."""


class _Overtime(BaseException):
    """Raised in a render past its deadline. A BaseException, so that no `except Exception` inside
    Jinja can swallow it."""


class _Watchdog:
    """Stops the calling thread's render after `seconds`: the deadline thread (_deadlines) raises
    _Overtime in it (PyThreadState_SetAsyncExc), which Python delivers between bytecodes, so any
    loop of the compiled template stops, over whatever it iterates. Leaving the block withdraws the
    deadline and, under the same lock, clears an exception not yet delivered, so none can escape the
    render. One thread serves every render: a thread a render (a timer) made the server's memory
    climb with chat traffic (tests/test_soak.py)."""

    def __init__(self, seconds: float) -> None:
        self._thread = threading.get_ident()
        self._seconds = seconds
        self._active, self._fired = True, False

    def __enter__(self) -> _Watchdog:
        _deadlines.add(self, time.monotonic() + self._seconds)
        return self

    def __exit__(self, *exc) -> None:
        with _deadlines.lock:
            _deadlines.due.pop(self, None)
            self._active = False
            if self._fired:
                _raise_in(self._thread, None)

    def fire(self) -> None:   # under _deadlines.lock
        if self._active:
            self._fired = True
            _raise_in(self._thread, _Overtime)


class _Deadlines:
    """The renders' deadlines and the one daemon thread that fires them, started at the first."""

    def __init__(self) -> None:
        self.lock = threading.Condition()
        self.due: dict[_Watchdog, float] = {}
        self._thread: threading.Thread | None = None

    def add(self, watchdog: _Watchdog, deadline: float) -> None:
        with self.lock:
            self.due[watchdog] = deadline
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="warploop-template-deadlines", daemon=True)
                self._thread.start()
            self.lock.notify()

    def _run(self) -> None:
        with self.lock:
            while True:
                now = time.monotonic()
                for watchdog in [w for w, at in self.due.items() if at <= now]:
                    del self.due[watchdog]
                    watchdog.fire()
                self.lock.wait(min(self.due.values(), default=now + 60.0) - now)


_deadlines = _Deadlines()


def _raise_in(thread: int, exc_type: type | None) -> None:
    """Schedule `exc_type` in `thread` (None: cancel a scheduled one)."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread),
                                               ctypes.py_object(exc_type) if exc_type else None)


class _Budget(threading.local):
    """The running render's range budget, per thread: the server renders in a thread pool."""
    steps = 0

    def spend(self, steps: int) -> None:
        self.steps += steps
        if self.steps > MAX_RANGE_STEPS:
            raise ChatTemplateError(f"it iterates over more than {MAX_RANGE_STEPS} range items")


_budget = _Budget()


def _budgeted_range(*args: int) -> range:
    # Charged up front, so nested loops multiply against one budget: the total of range items a
    # render iterates over is bounded, and with it the time spent in range loops.
    items = range(*args)
    _budget.spend(len(items))
    return items


def _size_of_product(left, right) -> int:
    for seq, count in ((left, right), (right, left)):
        if isinstance(seq, str | list | tuple) and isinstance(count, int):
            return len(seq) * max(count, 0)
    return 0


@functools.lru_cache(maxsize=1)
def _environment():
    import jinja2.ext
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class LimitedSandbox(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**"})

        def call_binop(self, context, operator, left, right):
            if operator == "**" and isinstance(right, int) and abs(right) > MAX_POWER_EXPONENT:
                raise ChatTemplateError(f"it raises to the power {right} (at most {MAX_POWER_EXPONENT})")
            if operator == "*" and _size_of_product(left, right) > MAX_OUTPUT_CHARS:
                raise ChatTemplateError(f"it builds a sequence longer than {MAX_OUTPUT_CHARS} items")
            return super().call_binop(context, operator, left, right)

    def raise_exception(message):
        raise TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = LimitedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    env.globals["range"] = _budgeted_range
    return env


@functools.lru_cache(maxsize=8)
def _compiled(source: str):
    return _environment().from_string(source)


def render_chat_template(source: str, **variables) -> str:
    """The template rendered with `variables`, or ChatTemplateError saying why not."""
    from jinja2.exceptions import TemplateError

    _budget.steps = 0
    try:
        with _Watchdog(MAX_SECONDS):
            return _render(source, variables)
    except _Overtime:
        raise ChatTemplateError(f"the chat template was stopped: it ran longer than {MAX_SECONDS:g} s") from None
    except ChatTemplateError as e:
        raise ChatTemplateError(f"the chat template was stopped: {e}") from None
    except TemplateError as e:  # raise_exception(...) in the template, or a syntax error
        raise ChatTemplateError(f"the chat template rejected the messages: {e}") from None
    except RecursionError:
        raise ChatTemplateError("the chat template recursed too deeply; fix the model's chat template") from None
    except Exception as e:  # the template's own bug (1/0, a bad filter argument): not the server's
        raise ChatTemplateError(f"the chat template failed: {type(e).__name__}: {e}; fix the model's "
                                "chat template") from None


def _render(source: str, variables: dict) -> str:
    pieces, size = [], 0
    for piece in _compiled(source).generate(**variables):
        size += len(piece)
        if size > MAX_OUTPUT_CHARS:
            raise ChatTemplateError(f"its output exceeds {MAX_OUTPUT_CHARS} characters")
        pieces.append(piece)
    return "".join(pieces)
