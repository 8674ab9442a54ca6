"""SM clock samples during `warploop bench runtime`, to explain run-to-run spread.

Latency-bound figures (the resident kernel's tile bodies, per-op launches) scale with the SM clock;
bandwidth-bound ones (the CUDA-graph MLP peer) barely move. An earlier run measured everything
latency-bound 1.3-1.7x slower in one process than in another with clocks unrecorded. A thread polls
`nvidia-smi` (read-only queries; nothing is changed) and each bench section reports the clocks seen
while it ran.
"""
from __future__ import annotations

import shutil
import statistics
import subprocess
import threading
import time

QUERY = ["--query-gpu=clocks.sm,clocks.mem,temperature.gpu,power.draw", "--format=csv,noheader,nounits"]


class ClockSampler:
    """Samples (host time, SM MHz, memory MHz, °C, W) every `period_s` until stop()."""

    def __init__(self, period_s: float = 0.25) -> None:
        self.period_s = period_s
        self.samples: list[tuple[float, float, float, float, float]] = []
        self.error: str | None = None
        self._stop = threading.Event()
        self._paused = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> ClockSampler:
        exe = shutil.which("nvidia-smi")
        if exe is None:
            self.error = "nvidia-smi not found"
            return self
        self._thread = threading.Thread(target=self._run, args=(exe,), daemon=True)
        self._thread.start()
        return self

    def _run(self, exe: str) -> None:
        while not self._stop.is_set():
            if self._paused.is_set():
                self._stop.wait(self.period_s)
                continue
            try:
                out = subprocess.run([exe, *QUERY], capture_output=True, text=True, timeout=5).stdout
                values = [float(v) for v in out.splitlines()[0].split(",")]
                self.samples.append((time.time(), *values[:4]))
            except (OSError, ValueError, IndexError, subprocess.SubprocessError) as exc:
                self.error = f"{type(exc).__name__}: {exc}"[:200]
            self._stop.wait(self.period_s)

    def pause(self, paused: bool) -> None:
        """Stop sampling while host-latency figures (submit round trips) are measured."""
        if paused:
            self._paused.set()
        else:
            self._paused.clear()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def window(self, t0: float, t1: float) -> dict | None:
        """SM clock (min/median/max MHz), memory clock, temperature and power seen in [t0, t1]."""
        seen = [s for s in self.samples if t0 <= s[0] <= t1]
        if not seen:
            return None
        sm = [s[1] for s in seen]
        return {"samples": len(seen), "sm_mhz_min": min(sm), "sm_mhz_median": statistics.median(sm),
                "sm_mhz_max": max(sm), "mem_mhz_median": statistics.median(s[2] for s in seen),
                "temp_c_max": max(s[3] for s in seen), "power_w_max": max(s[4] for s in seen)}
