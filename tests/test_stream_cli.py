"""`warploop bench stream` on a machine without a Hopper GPU: one JSON object that says why it did
not run, and bad arguments refused before anything runs, naming the flag."""
import json
import os
import subprocess
import sys

import pytest


def run(*args):
    env = {**os.environ, "WARPLOOP_DEVICE": "cpu", "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run([sys.executable, "-m", "warploop.cli", "bench", "stream", *args], capture_output=True,
                          text=True, env=env, timeout=300)


def test_without_a_hopper_gpu_it_says_so_in_its_json():
    out = run("--json")
    assert out.returncode == 0, out.stderr[-2000:]
    data = json.loads(out.stdout)
    assert {"device", "date", "versions"} <= set(data) and "Hopper" in data["skipped"]


@pytest.mark.parametrize("args, message", [
    (("--configs", "8x32"), "--configs: '8x32' is not RINGxROWSxBK"),
    (("--contexts", "0"), "--contexts"),
    (("--models", "gpt2"), "--models: unknown ['gpt2']"),
    (("--runs", "1"), "--runs must be at least 3"),
])
def test_bad_arguments_are_refused_naming_the_flag(args, message):
    out = run(*args)
    assert out.returncode != 0
    assert message in out.stderr
