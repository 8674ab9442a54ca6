"""`warploop bench stream` on a machine without a Hopper GPU: one JSON object that says why it did
not run, and bad arguments refused before anything runs, naming the flag."""
import json
import os
import subprocess
import sys

import pytest

from warploop import cli


def run(*args):
    env = {**os.environ, "WARPLOOP_DEVICE": "cpu", "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run([sys.executable, "-m", "warploop.cli", "bench", "stream", *args], capture_output=True,
                          text=True, env=env, timeout=300)


def test_without_a_hopper_gpu_it_says_so_in_its_json():
    out = run("--json")
    assert out.returncode == 0, out.stderr[-2000:]
    data = json.loads(out.stdout)
    assert {"device", "date", "versions"} <= set(data) and "Hopper" in data["skipped"]


def run_in_process(capsys, monkeypatch, *args) -> tuple[int, str]:
    """(exit status, stderr) of `warploop bench stream ARGS` as the command line would end, run in this
    process: the refusals need no interpreter of their own (one costs ~2 s of imports on CI's cores).
    SystemExit as Python's exit makes it: a string is printed to stderr with status 1, None is 0."""
    monkeypatch.setenv("WARPLOOP_DEVICE", "cpu")
    try:
        code = cli.main(["bench", "stream", *args])
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err
    if code is None or isinstance(code, int):
        return code or 0, err
    return 1, f"{err}{code}\n"


@pytest.mark.parametrize("args, message", [
    (("--configs", "8x32"), "--configs: '8x32' is not RINGxROWSxBK"),
    (("--contexts", "0"), "--contexts"),
    (("--models", "gpt2"), "--models: unknown ['gpt2']"),
    (("--runs", "1"), "--runs must be at least 3"),
])
def test_bad_arguments_are_refused_naming_the_flag(capsys, monkeypatch, args, message):
    code, err = run_in_process(capsys, monkeypatch, *args)
    assert code != 0
    assert message in err
