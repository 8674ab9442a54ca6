"""`warploop serve` starts cold on a Hopper GPU with no compiler (issue 35): a SmolLM2-135M-shaped
checkpoint, empty Triton and warploop caches, Triton blocked in the server's process; the first
request's answer within 10 s of the command, and a 16-token stream after it runs clean (decode loops,
no compile, no fallback). Skips without a Hopper GPU. scripts/serve_cold.py measures all three bench
shapes (scripts/device_stream.sh PART=cold)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("httpx")
pytest.importorskip("uvicorn")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                                reason="needs a Hopper GPU")
ROOT = Path(__file__).resolve().parents[1]
FIRST_TOKEN_S = 10.0


def test_a_cold_server_answers_within_ten_seconds_with_no_compiler(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "serve_cold.py"), "--models", "smollm2-135m",
                          "--block-triton", "--dir", str(tmp_path), "--timeout", "120"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    got = json.loads(out.stdout)["models"]["smollm2-135m"]
    assert got["finish_reason"] == "length" and got["noticed"] == [], got
    assert got["first_token_s"] <= FIRST_TOKEN_S, got
