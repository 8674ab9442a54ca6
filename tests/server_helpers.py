"""A `warploop serve --model tiny` subprocess on a free loopback port, for the tests/test_server*.py files."""
from __future__ import annotations

import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

httpx = pytest.importorskip("httpx")

ROOT = pathlib.Path(__file__).resolve().parents[1]
SERVE = [sys.executable, "-m", "warploop.cli", "serve"]
KEY = "test-key"
START_TIMEOUT_S = 120
ABORTED = "warploop_requests_finished_total{finish_reason=abort}"


class Server:
    def __init__(self, extra: list[str], log: pathlib.Path, preexec_fn=None, start_timeout_s: float = START_TIMEOUT_S,
                 env: dict | None = None) -> None:
        env = dict(os.environ, WARPLOOP_DEVICE="cpu", PYTHONUNBUFFERED="1", **(env or {}))
        self.start_timeout_s = start_timeout_s
        self.log = log
        self._log_file = open(log, "w")
        self.proc = subprocess.Popen([*SERVE, "--model", "tiny", "--port", "0", "--log-level", "warning", *extra],
                                     stdout=self._log_file, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                     preexec_fn=preexec_fn)
        try:
            self.url = self._wait_for_url()
            self._wait_healthy()
        except BaseException:
            self.proc.kill()
            self.proc.wait()
            raise

    def _wait_for_url(self) -> str:
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            match = re.search(r"serving .* on (http://\S+) ", self.log.read_text())
            if match:
                return match.group(1)
            assert self.proc.poll() is None, f"warploop serve exited early:\n{self.log.read_text()}"
            time.sleep(0.1)
        raise AssertionError(f"warploop serve did not start in {self.start_timeout_s} s:\n{self.log.read_text()}")

    def _wait_healthy(self) -> None:
        for _ in range(200):
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"/health never answered 200:\n{self.log.read_text()}")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log_file.close()
        return self.proc.returncode

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics, keyed 'name{label=value,...}' (no labels: just the name)."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        samples = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return samples
