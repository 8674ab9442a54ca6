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
    # the server's start line: the seconds since the command, and its parts, the stream program's placement
    assert got["started"].startswith("started in ") and "load" in got["started"] and "place" in got["started"]


def test_a_start_that_fails_is_reported_with_the_servers_words(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "serve_cold.py"), "--models", "small-cpu",
                          "--device", "cpu", "--dir", str(tmp_path), "--timeout", "120",
                          "--", "--max-num-seqs", "0"], capture_output=True, text=True, timeout=240)
    assert out.returncode == 1
    got = json.loads(out.stdout)["models"]["small-cpu"]
    assert "error" in got and any("max-num-seqs" in line for line in got["log"]), got


def test_the_start_line_names_each_part_and_what_came_before(monkeypatch):
    from warploop.llm import server_cli
    from warploop.llm.engine import Engine

    engine = type("E", (), {"start_s": {"load": 1.0, "backend": 2.0, "backend.pack": 0.25, "backend.place": 1.5,
                                        "warmup": 0.5}})()
    monkeypatch.setattr(server_cli, "process_age_s", lambda: 6.0)
    assert server_cli.start_line(engine) == ("started in 6.00 s (imports 2.50 s, load 1.00 s, backend 2.00 s "
                                             "(pack 0.25 s, place 1.50 s), warmup 0.50 s)")
    assert server_cli.start_line(object()) == "started in 6.00 s"       # a pool of replicas: no parts
    monkeypatch.setattr(server_cli, "process_age_s", lambda: None)
    assert server_cli.start_line(object()) == "started"
    with Engine.from_model("tiny", device="cpu") as real:        # every engine times its parts
        assert list(real.start_s) == ["load", "backend", "warmup"] and all(v >= 0 for v in real.start_s.values())
