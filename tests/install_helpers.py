"""Shared by the install tests: they build this project without build isolation, to take seconds.

The newest-torch resolve (tests/test_install.py) runs in the background. Its `pip install --dry-run`
downloads every wheel it resolves, torch's CUDA wheels too (about 2.7 GB: pip 23 fetches them even for
a dry run), 40-100 s on CI's 2 cores, mostly network and disk, all of it holding a pytest-xdist worker.
tests/conftest.py starts it once the run is collected (`start_resolve`; under xdist the controller
does), niced, so it overlaps the other tests; the test waits for its result (`resolve_result`) and
checks it as it checked the dry run before. Where nothing started it, the test starts it and waits.
`python tests/install_helpers.py DIR` is the background job.
"""
from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESOLVE_TEST = "tests/test_install.py::test_resolves_beside_the_newest_torch"
RESOLVE_TIMEOUT_S = 420         # the index query's 60 s and the dry run's 300 s, and the wait for a start
LOCAL_RUN = uuid.uuid4().hex    # the run's id without pytest-xdist (one process starts and waits)


def setuptools_for_spdx() -> bool:
    try:
        return int(importlib.metadata.version("setuptools").split(".")[0]) >= 77
    except importlib.metadata.PackageNotFoundError:
        return False


def require_setuptools_for_spdx() -> None:
    """pyproject's SPDX `license` string needs setuptools 77; without build isolation the installed one builds."""
    if not setuptools_for_spdx():
        pytest.skip("needs setuptools>=77 installed (pip install -U setuptools): the build runs without isolation")


def pip(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """pip in this interpreter without this machine's constraints file (it caps torch at the wheels on
    its disk; the point is what a user with the newest torch would get)."""
    env = {**os.environ, "PIP_CONSTRAINT": os.devnull, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    return subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True, env=env,
                          timeout=timeout)


def newest_version(returncode: int, stdout: str) -> str | None:
    """The version `pip index versions` printed first (the newest), None if the index did not answer."""
    if returncode != 0 or "(" not in stdout:
        return None
    return stdout.split("(", 1)[1].split(")", 1)[0]


def planned(report: dict) -> dict[str, str]:
    """{name: version} that `pip install` would install, from its JSON report."""
    return {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in report["install"]}


def _completed(proc: subprocess.CompletedProcess) -> dict:
    return {"returncode": proc.returncode, "stdout": proc.stdout, "stderr": proc.stderr}


def _resolve(where: Path) -> None:
    """The background job: the newest torch on the index, then the dry run of this project beside it
    (--ignore-installed: what a fresh environment would get), into where/result.json."""
    # niced (pip inherits it): the download mostly waits on the network and disk, and its CPU share
    # (~45 s of pip on CI) should go where the tests leave a core idle rather than slow them
    os.nice(10)
    result: dict = {}
    try:
        result["index"] = _completed(pip("index", "versions", "torch", timeout=60))
        torch_version = newest_version(result["index"]["returncode"], result["index"]["stdout"])
        if torch_version is not None:
            report = where / "report.json"
            dry = pip("install", "--dry-run", "--quiet", "--no-build-isolation", "--ignore-installed", "--report",
                      str(report), str(ROOT), f"torch=={torch_version}")
            result["dry_run"] = _completed(dry)
            result["report"] = json.loads(report.read_text()) if dry.returncode == 0 else None
    except Exception as exc:    # a timeout, say: the test fails naming it
        result["error"] = repr(exc)
    partial = where / "result.json.partial"
    partial.write_text(json.dumps(result))
    partial.replace(where / "result.json")


def resolve_dir(run: str) -> Path:
    return Path(tempfile.gettempdir()) / f"warploop-resolve-{run}"


_started: dict[Path, subprocess.Popen] = {}


def start_resolve(run: str) -> None:
    """Start the background resolve for run `run`, once (nothing to do without setuptools 77: the test skips)."""
    where = resolve_dir(run)
    if where in _started or not setuptools_for_spdx():
        return
    where.mkdir(exist_ok=True)
    with open(where / "log.txt", "w") as log:
        # a process group of its own (stop_resolves ends pip with it), but not a session: Linux's
        # autogroup would give a new session a core's fair share beside all of pytest's, nice or not
        _started[where] = subprocess.Popen([sys.executable, __file__, str(where)], stdout=log,
                                           stderr=subprocess.STDOUT, process_group=0)
    pid = where / "pid.partial"
    pid.write_text(str(_started[where].pid))
    pid.replace(where / "pid")


def stop_resolves() -> None:
    """At the end of the session that started them: stop any still running (the test was not reached)."""
    for where, proc in _started.items():
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        shutil.rmtree(where, ignore_errors=True)
    _started.clear()


def _running(pid: int) -> bool:
    """Whether process `pid` runs (under xdist a worker waits for the controller's child: not a zombie)."""
    if not Path("/proc").is_dir():
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def resolve_result() -> dict:
    """What the background resolve found, once it has (started here if nothing started it)."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID") or LOCAL_RUN
    where = resolve_dir(run)
    if not (where / "pid").exists():
        start_resolve(run)
    pid = int((where / "pid").read_text())
    deadline = time.monotonic() + RESOLVE_TIMEOUT_S
    while not (where / "result.json").exists():
        assert _running(pid), f"the background resolve ended without a result:\n{(where / 'log.txt').read_text()}"
        assert time.monotonic() < deadline, f"no result from the background resolve in {RESOLVE_TIMEOUT_S} s"
        time.sleep(0.5)
    return json.loads((where / "result.json").read_text())


if __name__ == "__main__":
    _resolve(Path(sys.argv[1]))
