"""scripts/serve_cold.py and scripts/checkpoint.py on the CPU: the cold-start measurement a GPU run
makes (issue 35's 10 s goal) works before it spends device time."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("httpx")
pytest.importorskip("uvicorn")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))


def test_a_checkpoint_written_for_each_bench_shape_loads_back_as_that_shape(tmp_path):
    from checkpoint import hf_config

    from warploop.llm.config import ModelConfig
    from warploop.llm.shapes import CPU_MODELS, GPU_MODELS
    for name, (_, cfg) in {**GPU_MODELS, **CPU_MODELS}.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(hf_config(cfg)))
        assert ModelConfig.from_dir(str(tmp_path / name)) == cfg, name


def test_a_cold_serve_with_triton_blocked_answers_and_runs_clean(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "serve_cold.py"), "--models", "small-cpu",
                          "--device", "cpu", "--block-triton", "--dir", str(tmp_path), "--timeout", "120",
                          "--", "--backend", "stream", "--dtype", "bfloat16"],
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout)["models"]["small-cpu"]
    assert 0 < got["ready_s"] <= got["first_token_s"] < 120
    assert got["finish_reason"] == "length" and got["noticed"] == []


def test_a_start_that_fails_is_reported_with_the_servers_words(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "serve_cold.py"), "--models", "small-cpu",
                          "--device", "cpu", "--dir", str(tmp_path), "--timeout", "120",
                          "--", "--max-num-seqs", "0"], capture_output=True, text=True, timeout=240)
    assert out.returncode == 1
    got = json.loads(out.stdout)["models"]["small-cpu"]
    assert "error" in got and any("max-num-seqs" in line for line in got["log"]), got
