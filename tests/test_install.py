"""The install resolves beside the user's torch: pip neither fails nor replaces torch or Triton.

Dry runs against the package index (metadata only, nothing is installed). They skip when the index
cannot be reached. This machine caps torch with a pip constraints file of the wheels on its disk;
the dry runs lift that cap, because the point is what a user with the newest torch would get.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from install_helpers import require_setuptools_for_spdx

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def _pip(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PIP_CONSTRAINT": os.devnull, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    return subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True, env=env,
                          timeout=timeout)


def _newest(package: str) -> str:
    proc = _pip("index", "versions", package, timeout=60)
    if proc.returncode != 0 or "(" not in proc.stdout:
        pytest.skip(f"the package index does not answer for {package}: {proc.stderr.strip()[-200:]}")
    return proc.stdout.split("(", 1)[1].split(")", 1)[0]


def _dry_run(tmp_path: Path, *requirements: str, ignore_installed: bool) -> dict[str, str]:
    """{name: version} that `pip install` would install, from its JSON report."""
    require_setuptools_for_spdx()
    report = tmp_path / "report.json"
    flags = ["--ignore-installed"] if ignore_installed else []
    proc = _pip("install", "--dry-run", "--quiet", "--no-build-isolation", *flags, "--report", str(report),
                *requirements)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in json.loads(report.read_text())["install"]}


def test_resolves_beside_the_newest_torch(tmp_path):
    torch_version = _newest("torch")
    plan = _dry_run(tmp_path, str(ROOT), f"torch=={torch_version}", ignore_installed=True)
    assert plan["torch"] == torch_version  # pip kept the torch asked for instead of backtracking to an older one
    assert "warploop" in plan
    if sys.platform == "linux":
        major, minor = (int(p) for p in plan["triton"].split(".")[:2])
        assert (3, 6) <= (major, minor) < (4, 0), plan["triton"]


def test_keeps_the_installed_torch_and_triton(tmp_path):
    pytest.importorskip("torch")
    _newest("torch")  # skip offline
    plan = _dry_run(tmp_path, str(ROOT), ignore_installed=False)
    assert "torch" not in plan and "triton" not in plan, plan

