"""A short soak of `warploop serve --model tiny` on the CPU (scripts/soak.py; the long run is the script):
mixed traffic (streams, chats, cancellations, bad and oversized requests, slow clients), then every KV
block free, RSS within 10% of its post-warm-up level, no file descriptor leaked, every good request
answered exactly once."""
from __future__ import annotations

import importlib.util
import sys

import pytest
from server_helpers import ROOT

pytest.importorskip("httpx")
pytestmark = [pytest.mark.skipif(not (ROOT / "warploop/llm/tiny/config.json").exists(), reason="needs the tiny model"),
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="samples RSS and fds from /proc")]

spec = importlib.util.spec_from_file_location("soak", ROOT / "scripts" / "soak.py")
soak = sys.modules["soak"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(soak)

# RSS climbs to a plateau during the first requests (a 4-minute soak: +6.9%, then level); 10 s of warm-up
# were not enough to reach it when the test shares 2 cores with another worker (CI: 427.8 -> 470.8 MB).
# 10 s of soak after it: every kind of request, 100-150 of them (the last still end up to ~10 s later,
# a slow client's stream), against the same checks; scripts/soak.py is the long run
WARMUP_S, SOAK_S = 20, 10


def test_short_soak_leaks_nothing():
    with soak.serving(["--max-body-bytes", str(soak.MAX_BODY)]) as (url, pid):
        result = soak.soak(url, pid, SOAK_S, concurrency=8, seed=0, warmup_s=WARMUP_S)
    print(result)
    assert not result["problems"], result
    assert set(result["answered"]) == set(soak.KINDS) and result["requests"] > 50
    assert result["answered"] == result["sent"]
