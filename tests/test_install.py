"""The install resolves beside the user's torch: pip neither fails nor replaces torch or Triton.

Dry runs against the package index (metadata only, nothing is installed). They skip when the index
cannot be reached. This machine caps torch with a pip constraints file of the wheels on its disk;
the dry runs lift that cap, because the point is what a user with the newest torch would get.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from install_helpers import ROOT, newest_version, pip, planned, require_setuptools_for_spdx, resolve_result

pytestmark = pytest.mark.slow


def _newest(package: str) -> str:
    proc = pip("index", "versions", package, timeout=60)
    newest = newest_version(proc.returncode, proc.stdout)
    if newest is None:
        pytest.skip(f"the package index does not answer for {package}: {proc.stderr.strip()[-200:]}")
    return newest


def _dry_run(tmp_path: Path, *requirements: str, ignore_installed: bool) -> dict[str, str]:
    """{name: version} that `pip install` would install, from its JSON report."""
    require_setuptools_for_spdx()
    report = tmp_path / "report.json"
    flags = ["--ignore-installed"] if ignore_installed else []
    proc = pip("install", "--dry-run", "--quiet", "--no-build-isolation", *flags, "--report", str(report),
               *requirements)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return planned(json.loads(report.read_text()))


def test_resolves_beside_the_newest_torch():
    """The dry run of this project beside the newest torch, with --ignore-installed; it runs in the
    background from the start of the session (install_helpers.py says why) and this checks its result."""
    require_setuptools_for_spdx()
    result = resolve_result()
    assert "error" not in result, result["error"]
    torch_version = newest_version(result["index"]["returncode"], result["index"]["stdout"])
    if torch_version is None:
        pytest.skip(f"the package index does not answer for torch: {result['index']['stderr'].strip()[-200:]}")
    assert result["dry_run"]["returncode"] == 0, result["dry_run"]["stderr"][-3000:]
    plan = planned(result["report"])
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

