import json
import subprocess
import sys

import pytest

from warploop import config
from warploop.target import CPU, Target, probe_devices, select_device


@pytest.mark.parametrize("text,expected", [
    ("cuda:90", Target("cuda", 90, 32)),
    ("cuda:sm_80", Target("cuda", 80, 32)),
    ("hip:gfx942", Target("hip", "gfx942", 64)),
    ("hip:gfx1100", Target("hip", "gfx1100", 32)),
    ("cpu", CPU),
])
def test_parse_and_str_round_trip(text, expected):
    target = Target.parse(text)
    assert target == expected
    assert Target.parse(str(target)) == target


@pytest.mark.parametrize("bad", ["cuda", "cuda:x", "hip:942", "metal:1", ""])
def test_parse_rejects_bad_text(bad):
    with pytest.raises(ValueError, match="target"):
        Target.parse(bad)


def test_target_is_frozen_and_hashable():
    t = Target.parse("cuda:90")
    with pytest.raises(AttributeError):
        t.arch = 80
    assert {t: 1}[Target("cuda", 90, 32)] == 1


def test_cpu_is_always_probed_last():
    devices = probe_devices()
    assert devices[-1].target == CPU


def test_warploop_device_env_forces_cpu(monkeypatch):
    monkeypatch.setenv("WARPLOOP_DEVICE", "cpu")
    config.reload()
    try:
        assert select_device().target == CPU
    finally:
        monkeypatch.delenv("WARPLOOP_DEVICE")
        config.reload()


def test_bad_warploop_device_env_is_refused(monkeypatch):
    monkeypatch.setenv("WARPLOOP_DEVICE", "tpu")
    with pytest.raises(ValueError, match="WARPLOOP_DEVICE"):
        config.reload()
    monkeypatch.delenv("WARPLOOP_DEVICE")
    config.reload()


def test_info_json_contract():
    out = subprocess.run([sys.executable, "-m", "warploop.cli", "info", "--json"],
                         capture_output=True, text=True, check=True, env={"WARPLOOP_DEVICE": "cpu", "PATH": ""})
    data = json.loads(out.stdout)
    assert data["selected"]["backend"] == "cpu"
    assert {"backend", "arch", "warp_size"} <= set(data["selected"])
    assert any(d["backend"] == "cpu" for d in data["devices"])
