"""scripts/serve_load.py on the CPU (the tiny model, a few small requests): `warploop serve` with one
engine and with two replicas each answer a round of concurrent completions, counted token for token,
before a GPU run spends device time on issue 36's figure; a system that fails records its error and
log, and the next still runs. The `ray` system's test is in tests/test_ray_serve.py (it needs Ray)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("httpx")
pytest.importorskip("uvicorn")
SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "serve_load.py"
SMOKE = ["--device", "cpu", "--concurrency", "4", "--max-tokens", "6", "--rounds", "1", "--timeout", "90"]


def run(*args: str) -> tuple[int, dict]:
    out = subprocess.run([sys.executable, str(SCRIPT), *SMOKE, *args], capture_output=True, text=True, timeout=240)
    assert out.stdout, out.stderr[-3000:]
    return out.returncode, json.loads(out.stdout)


def test_one_engine_and_two_replicas_serve_a_counted_round():
    rc, got = run("--model", "tiny", "--systems", "one,replicas")
    assert rc == 0, got
    assert got["engine"] == {"max_num_seqs": 64, "max_model_len": 1024, "enable_prefix_caching": False,
                             "device": "cpu"}
    for name in ("one", "replicas"):
        system = got["systems"][name]
        assert system["tok_s"] > 0 and system["ready_s"] > 0, system
        assert system["tokens_per_round"] == system["expected_tokens_per_round"] == 4 * 6, system
        assert system["short_completions"] == 0
        assert 0 < system["latency_p50_s"] <= system["latency_p99_s"]
        assert system["stop"] == "clean", system       # SIGTERM to the server stopped all it started
    one, replicas = got["systems"]["one"]["tok_s"], got["systems"]["replicas"]["tok_s"]
    assert got["ratio"]["replicas"] == pytest.approx(replicas / one, rel=1e-2)


def test_a_system_that_fails_records_its_error_and_the_next_runs(tmp_path):
    rc, got = run("--model", str(tmp_path / "missing"), "--systems", "one,replicas")
    assert rc == 1
    for name in ("one", "replicas"):
        error = got["systems"][name]
        assert error["error"].startswith(f"RuntimeError: {name}: the server exited with code"), error
        assert any("missing" in line for line in error["log"]), error
    assert got["ratio"] == {}
