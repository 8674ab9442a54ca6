"""A served system as a process group of its own (scripts/serve_load.py): a free port, waiting until
it serves, the tail of its log, a py-spy on each of its Python processes, and its stop (SIGTERM to
its first process, then to what is left of the group, then SIGKILL), with how it stopped."""
from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

STOP_GRACE_S = 60.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def log_tail(path: Path, lines: int = 25) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return []


def wait_ready(name: str, proc: subprocess.Popen, url: str, log_path: Path, deadline: float) -> str:
    """The served model's name once the system's log says it serves (`warploop serve` once every
    engine has loaded; the Ray process once serve.run has every replica running) and `url`/health
    answers 200; an error naming `name` if the process ends or the deadline passes first."""
    import httpx

    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{name}: the server exited with code {proc.returncode} before it served")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{name}: not serving (a 'serving' line and /health 200) within the system's "
                               "time limit")
        if "\nserving " in "\n" + log_path.read_text(errors="replace"):
            try:
                r = httpx.get(f"{url}/health", timeout=2.0)
                if r.status_code == 200:
                    return r.json()["model"]
            except httpx.HTTPError:
                pass
        time.sleep(0.5)


def live_members(pgid: int) -> list[int]:
    """The processes of group `pgid` that are not zombies (Linux: /proc)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()    # state, ppid, pgrp, ...
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            pids.append(int(stat.parent.name))
    return pids


def stop_group(proc: subprocess.Popen) -> str:
    """Stop a system: SIGTERM to its first process, which stops what it started (`warploop serve` its
    replicas, the Ray process Serve and Ray); what is left of its process group after that (or after
    STOP_GRACE_S) gets SIGTERM, then SIGKILL. Returns "clean" when nothing was left to signal, else
    what it took ("SIGTERM", "SIGKILL"; "left running: PIDS" if even that failed)."""
    proc.terminate()
    try:
        proc.wait(STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        pass
    for outcome, wait_s, then in (("clean", 1.0, signal.SIGTERM), ("SIGTERM", 10.0, signal.SIGKILL),
                                  ("SIGKILL", 10.0, None)):
        deadline = time.monotonic() + wait_s
        while live_members(proc.pid):
            if time.monotonic() > deadline:
                break
            time.sleep(0.1)
        else:
            return outcome
        if then is not None:
            for pid in live_members(proc.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, then)
    proc.poll()
    return f"left running: {live_members(proc.pid)}"


def start_profile(args: argparse.Namespace, name: str, pgid: int) -> list[subprocess.Popen]:
    """A py-spy on each Python process of group `pgid` for the timed rounds (--profile); py-spy's own
    --subprocesses left the replicas' engines out."""
    if not args.profile:
        return []
    seconds = max(2, int(args.rounds * args.max_tokens * 0.03) + 2)     # about the rounds at 30 ms a step
    spies = []
    for pid in live_members(pgid):
        with contextlib.suppress(OSError):
            if b"python" not in Path(f"/proc/{pid}/cmdline").read_bytes():
                continue
            spies.append(subprocess.Popen(
                [args.py_spy, "record", "--pid", str(pid), "--threads", "--nonblocking", "--rate", "100",
                 "--duration", str(seconds), "--format", "raw",
                 "-o", str(Path(args.profile) / f"serve-{name}-{pid}.txt")],
                stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT))
    return spies
