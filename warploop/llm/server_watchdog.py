"""The server's watch over its engine: a fault that stops the engine (a GPU kernel that hangs, a
decode loop outliving its watchdog, a step that never returns) never leaves a request waiting.

A failure the engine sees (an exception from a step) already reaches the requests of that step as an
error (500, naming it) and the engine goes on with the next step. What it cannot see is a step that
never ends: then the engine thread is stuck and nothing more arrives. `EngineWatchdog` samples
`engine.stats()`; when requests are running and no token was produced for `timeout_s`, every open
request gets an error event naming the cause, and `on_stall(message)` is called (`warploop serve`
then stops: a stuck device cannot be trusted with the next request, and a supervisor restarts it).
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from warploop.llm.params import StreamEvent

DEFAULT_ENGINE_TIMEOUT_S = 600.0   # far past any step or first-use compile measured (docs/server.md)


class EngineWatchdog:
    def __init__(self, engine: Any, timeout_s: float, on_stall: Callable[[str], None]) -> None:
        if not timeout_s > 0:
            raise ValueError(f"--engine-timeout must be positive, got {timeout_s}")
        self._engine, self.timeout_s, self._on_stall = engine, timeout_s, on_stall
        self.jobs: set = set()          # the open requests (server._EngineRequest), failed on a stall
        self.stalled: str | None = None

    def _progress(self) -> tuple[int, int]:
        stats = self._engine.stats()
        return stats["running"], stats["generation_tokens_total"]

    async def run(self) -> None:
        period = min(1.0, self.timeout_s / 4)
        running, tokens = self._progress()
        since = time.monotonic()
        while self.stalled is None:
            await asyncio.sleep(period)
            running, now_tokens = self._progress()
            if running == 0 or now_tokens != tokens:
                tokens, since = now_tokens, time.monotonic()
            elif time.monotonic() - since > self.timeout_s:
                self.stall(f"the engine produced no token for {self.timeout_s:g} s (--engine-timeout) with "
                           f"{running} request(s) running: its device work hangs")

    def stall(self, message: str) -> None:
        """Fail every open request with `message` and report it (once)."""
        if self.stalled is not None:
            return
        self.stalled = message
        for job in list(self.jobs):
            job.fail(message)
        self._on_stall(message)


def is_device_fault(error: str) -> bool:
    """Whether an engine error (as StreamEvent.error: "Type: message") leaves the device unusable:
    a watchdog's timeout (the resident kernel or decode loop hangs) or a CUDA/HIP error, which is
    sticky. Any other exception fails its own requests only, and the engine goes on."""
    return error.startswith(("TimeoutError", "AcceleratorError")) or any(
        mark in error for mark in ("CUDA error", "HIP error", "hipError", "illegal memory access"))


def failure_event(request_id: str, prompt_tokens: int, completion_tokens: int, message: str) -> StreamEvent:
    return StreamEvent(request_id, None, "", "abort", prompt_tokens, completion_tokens, error=message)
