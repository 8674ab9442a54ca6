"""scripts/plot_benchmarks.py: % of the floor from the committed results, and the PNGs BENCHMARKS.md shows."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("plot_benchmarks", ROOT / "scripts" / "plot_benchmarks.py")
plot_benchmarks = importlib.util.module_from_spec(spec)
spec.loader.exec_module(plot_benchmarks)


def test_percent_of_floor_is_floor_over_time():
    data = {"floor_ms": 0.5, "warploop": {"ms_per_token_bs1": 1.0}, "hf_eager": {"ms_per_token_bs1": 10.0},
            "torch_compile": {"skipped": "needs a CUDA device"}}
    floor, rows = plot_benchmarks.bars(data, plot_benchmarks.FIGURES["decode"][0])
    assert floor == 0.5 and rows == [("warploop (per-op)", 1.0, 50.0), ("HF eager", 10.0, 5.0)]


def test_takes_the_newest_run_per_bench_and_device_and_leaves_probes_out(tmp_path):
    for name in ("decode-h200-20261121.json", "decode-h200-20261125.json", "decode-h100-20261101.json",
                 "runtime-mlp-probe-1-h200-20261121.json"):
        (tmp_path / name).write_text("{}")
    found = plot_benchmarks.newest_results(tmp_path)
    assert {k: v.name for k, v in found.items()} == {("decode", "h100"): "decode-h100-20261101.json",
                                                     ("decode", "h200"): "decode-h200-20261125.json"}


def test_draws_every_committed_bench(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    assert plot_benchmarks.main(["--out", str(tmp_path)]) == 0
    committed = plot_benchmarks.newest_results(ROOT / "bench" / "results")
    for bench, device in committed:
        png = tmp_path / f"{bench}-{device}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert (ROOT / "docs" / "img" / png.name).is_file(), f"docs/img/{png.name}: rerun the script and commit"
    assert len(capsys.readouterr().out.splitlines()) == len(committed)


def test_without_matplotlib_says_how_to_install_it(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert plot_benchmarks.main([]) == 2
    assert "pip install 'warploop[plot]'" in capsys.readouterr().err


def test_every_figure_path_exists_in_a_committed_result():
    for (bench, _), file in plot_benchmarks.newest_results(ROOT / "bench" / "results").items():
        data = json.loads(file.read_text())
        for figure, part in plot_benchmarks.panels_of(bench, data):
            assert plot_benchmarks.bars(part, figure)[1], f"{file.name}: no system of {figure[0]!r}"


def test_a_decode_run_with_models_has_a_panel_per_model():
    data = {"models": {"a": {"floor_ms": 0.5, "megakernel": {"ms_per_token_bs1": 0.6}},
                       "b": {"floor_ms": 0.1, "warploop": {"ms_per_token_bs1": 1.0}}}}
    panels = plot_benchmarks.panels_of("decode", data)
    assert [f[0].split(":")[0] for f, _ in panels] == ["a", "b"]
    assert plot_benchmarks.bars(panels[1][1], panels[1][0])[1] == [("warploop (per-op)", 1.0, 10.0)]
