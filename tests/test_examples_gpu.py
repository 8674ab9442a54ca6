"""Every example as a user runs it on a GPU: a fresh process, its own GPU sizes (1M elements for the
sort and the reduction), tensors made after the runtime starts, its own check (skipped without a GPU)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
ROOT = Path(__file__).resolve().parents[1]


def run_example(*argv: str) -> str:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]
    return p.stdout


@pytest.mark.parametrize("name, size", [("parallel_sort", "sorted 1048576 values"),
                                        ("tree_reduce", "sum of 1000000 values"),
                                        ("mlp_graph", "3 replays")])
def test_runtime_example_at_gpu_size(name, size):
    out = run_example(f"examples/{name}.py")
    assert out.startswith("cuda:") and size in out and out.rstrip().endswith("ok"), out


def test_gpu_grep_example():
    out = run_example("examples/gpu_grep.py", "def ", str(Path(json.__file__).parent))
    assert "matching lines" in out and "on cuda" in out, out


def test_bundle_demo_example():
    run_example("examples/bundle_demo.py")
