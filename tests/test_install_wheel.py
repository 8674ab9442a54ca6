"""A wheel that stands alone: built from the repository, installed into a fresh venv, and every
command run from a directory that holds no warploop source.

The venv sees the installed torch, Triton and the rest (--system-site-packages) and the wheel goes
in with --no-deps, so this takes seconds. What it checks is the wheel's own content: the tiny model,
the bench kernels and every module the commands import must ship inside it.
"""
from __future__ import annotations

import fcntl
import json
import os
import queue
import re
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import zipfile
from pathlib import Path

import pytest
from install_helpers import require_setuptools_for_spdx

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, Path, dict]:
    """(the venv's bin directory, a working directory outside the repository, the environment to run in)."""
    require_setuptools_for_spdx()
    root = tmp_path_factory.mktemp("wheel")
    # one build at a time: setuptools builds in the repository's build/ folder, and two pytest-xdist
    # workers that both run tests of this module would collide there ("File exists")
    with open(Path(tempfile.gettempdir()) / "warploop-wheel-build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w",
                                str(root / "dist"), str(ROOT)], capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-3000:]
    assert "project.license" not in build.stdout + build.stderr  # the SPDX string, not the deprecated table
    wheel = next((root / "dist").glob("warploop-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "warploop/bench/kernels.py" in names and "warploop/llm/tiny/config.json" in names
    assert "warploop/llm/shipped/ops.wlb" in names      # the per-op GPU kernels, compiled (ops_prebuilt.py)
    assert "warploop/runtime/stream/shipped/stream-kernels.json" in names
    # --without-pip: the venv runs the pip it sees among the system's packages (ensurepip's own copy
    # took 7 of the fixture's 13 s), and installs into the venv all the same
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(root / "venv")],
                   check=True, timeout=120)
    bin_dir = root / "venv" / "bin"
    # --ignore-installed: the venv also sees the warploop installed outside it (editable, same version)
    subprocess.run([str(bin_dir / "python"), "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                    "--ignore-installed", str(wheel)], check=True, timeout=300)
    work = root / "elsewhere"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"WARPLOOP_DEVICE": "cpu"}
    return bin_dir, work, env


def warploop(installed, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    bin_dir, work, env = installed
    proc = subprocess.run([str(bin_dir / "warploop"), *args], capture_output=True, text=True, cwd=work, env=env,
                          timeout=timeout)
    # stdout too: `bench bundle --json` exits 1 with every kernel's result in its JSON, not on stderr
    assert proc.returncode == 0, f"warploop {' '.join(args)}:\n{proc.stderr[-3000:]}\n{proc.stdout[-6000:]}"
    return proc


def test_the_venv_imports_the_installed_wheel(installed):
    bin_dir, work, env = installed
    where = subprocess.run([str(bin_dir / "python"), "-c", "import warploop; print(warploop.__file__)"],
                           capture_output=True, text=True, cwd=work, env=env, check=True).stdout.strip()
    assert where.startswith(str(bin_dir.parent)), where  # not the repository, not an editable install


def test_info(installed):
    data = json.loads(warploop(installed, "info", "--json").stdout)
    assert data["selected"]["backend"] == "cpu"
    # the prebuilt stream kernels ship inside the wheel, built from its own sources
    from warploop.llm.stream_shipped import SHIPPED_KERNELS
    stream = [p for p in data["prebuilt"] if p["kind"] == "stream"]
    assert {(p["kmax"], p["head_dim"], p["attn_group"]) for p in stream} == set(SHIPPED_KERNELS)
    assert all(p["current"] and p["target"] == "cuda:90" and p["dtype"] == "bf16" for p in stream)


def test_generate_with_the_embedded_model(installed):
    out = json.loads(warploop(installed, "generate", "--model", "tiny", "--prompt", "def ", "--max-tokens", "8",
                              "--json").stdout)
    assert len(out["token_ids"]) == 8 and out["text"]


def test_bundle_build_and_inspect(installed):
    work = installed[1]
    (work / "mine.py").write_text(
        "import triton\nimport triton.language as tl\nimport warploop\n\n"
        "@warploop.export(signature={'x': '*fp32', 'n': 'i32'}, constexprs={'B': 64})\n@triton.jit\n"
        "def twice(x, n, B: tl.constexpr):\n    o = tl.arange(0, B)\n"
        "    tl.store(x + o, 2 * tl.load(x + o, mask=o < n), mask=o < n)\n")
    built = warploop(installed, "bundle", "build", "mine.py", "-t", "cuda:90", "-t", "cpu", "-o", "mine.wlb")
    assert "1 kernels, 2 variants (1 compiled + 1 cpu source)" in built.stderr
    data = json.loads(warploop(installed, "bundle", "inspect", "mine.wlb", "--json").stdout)
    assert [v["target"] for v in data["kernels"][0]["variants"]] == ["cuda:90", "cpu"]


def test_bench_bundle_uses_the_kernels_shipped_in_the_package(installed):
    data = json.loads(warploop(installed, "bench", "bundle", "--json", "--repeats", "1").stdout)
    assert data["all_correct"] and len(data["kernels"]) == 12


def test_bench_decode(installed):
    # what the wheel must hold for the command (the engine, the check against transformers, the timing);
    # the whole contract, transformers' figures and the TTFTs too, is tests/test_llm_bench.py's
    data = json.loads(warploop(installed, "bench", "decode", "--json", "--steps", "2", "--repeats", "1",
                               "--batches", "2", "--no-ttft", "--skip", "hf_eager").stdout)
    model = data["models"]["small-cpu"]
    assert model["warploop"]["ms_per_token_bs1"] > 0 and model["floor_ms"] > 0


def test_bench_runtime_and_hostcall(installed):
    runtime = json.loads(warploop(installed, "bench", "runtime", "--json", "--quick").stdout)
    assert runtime["dependent_hop_us"] > 0
    hostcall = json.loads(warploop(installed, "bench", "hostcall", "--json").stdout)
    assert hostcall["print_lost"] == 0 and hostcall["calls_per_s"] > 0


def test_serve(installed):
    bin_dir, work, env = installed
    server = subprocess.Popen([str(bin_dir / "warploop"), "serve", "--model", "tiny", "--port", "0"], cwd=work,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in server.stdout], daemon=True).start()
    try:
        line = lines.get(timeout=120)  # "started in ..." (where the start went), then the serving line
        while not line.startswith("serving "):
            line = lines.get(timeout=120)  # "serving 'tiny' on http://127.0.0.1:PORT (...)"
        url = re.search(r"on (http://\S+) ", line).group(1)
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: no proxy
        deadline = time.monotonic() + 60
        while True:  # the line comes just before uvicorn starts accepting
            try:
                with opener.open(f"{url}/v1/models", timeout=30) as reply:
                    assert json.load(reply)["data"][0]["id"] == "tiny"
                break
            except urllib.error.URLError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
    finally:
        server.terminate()
        assert server.wait(timeout=60) == 0
