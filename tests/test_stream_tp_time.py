"""scripts/stream_tp_time.py on the CPU reference (gloo), a 2-layer model: one rank and two, each in
fresh processes, give their ms a token, floors and the speedup, so the script works before it spends
device time on two GPUs."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_script_times_one_rank_and_two_on_the_cpu():
    env = {k: v for k, v in os.environ.items() if k != "WARPLOOP_DEVICE"} | {"PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, str(ROOT / "scripts/stream_tp_time.py"), "--model", "small", "--device",
                          "cpu", "--runs", "2", "--worlds", "1,2", "--timeout", "200"],
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    data = json.loads(out.stdout)
    one, two = data["results"]
    assert "error" not in one and "error" not in two, data
    assert (one["world"], two["world"]) == (1, 2) and one["speedup"] == 1.0 and two["speedup"] > 0
    assert one["ms_per_token"] > 0 and two["rank_weight_gb"] < one["rank_weight_gb"]
