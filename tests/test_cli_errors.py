"""Mistakes on the command line end in one line that names the flag or variable and the fix; no traceback
unless --debug or WARPLOOP_DEBUG=1 asks for it."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from warploop import cli, config
from warploop.bundle.build import BUILD_TARGETS
from warploop.target import probe_devices

KERNELS = Path(__file__).resolve().parents[1] / "examples" / "kernels.py"
HAS_CUDA = any(d.target.backend == "cuda" for d in probe_devices())


@pytest.fixture
def env(monkeypatch):
    """Set WARPLOOP_* variables for one test; the cached config is dropped on the way in and out."""
    def set_env(**values: str) -> None:
        for k, v in values.items():
            monkeypatch.setenv(k, v)
        config.get.cache_clear()

    yield set_env
    monkeypatch.undo()
    config.get.cache_clear()


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def one_line_error(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


def test_max_tokens_zero_names_the_flag(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["generate", "--prompt", "x", "--max-tokens", "0"])
    line = one_line_error(capsys.readouterr().err)
    assert exit_.value.code == 2
    assert "--max-tokens" in line and "positive integer" in line and "SamplingParams" not in line


def test_sampling_errors_name_the_flag_not_the_field(capsys):
    code, _, err = run(capsys, "generate", "--prompt", "x", "--top-p", "1.5")
    line = one_line_error(err)
    assert code == 2 and "--top-p must be in (0, 1]" in line and "SamplingParams" not in line


@pytest.mark.skipif(HAS_CUDA, reason="needs a machine without a CUDA device")
def test_device_flag_without_a_gpu_names_the_flag(capsys):
    code, _, err = run(capsys, "generate", "--prompt", "x", "--device", "cuda")
    line = one_line_error(err)
    assert code == 2 and "--device cuda" in line and "--device cpu" in line and "device='cpu'" not in line


@pytest.mark.skipif(HAS_CUDA, reason="needs a machine without a CUDA device")
def test_device_variable_without_a_gpu_names_the_variable(capsys, env):
    env(WARPLOOP_DEVICE="cuda")
    code, _, err = run(capsys, "generate", "--prompt", "x")
    line = one_line_error(err)
    assert code == 2 and "WARPLOOP_DEVICE=cuda" in line and "unset WARPLOOP_DEVICE" in line


@pytest.mark.skipif(HAS_CUDA, reason="needs a machine without a CUDA device")
def test_info_explains_a_forced_backend_it_cannot_find(capsys, env):
    env(WARPLOOP_DEVICE="cuda")
    code, out, err = run(capsys, "info")
    assert code == 1 and "Traceback" not in out + err
    assert "cpu" in out.splitlines()[1]                       # the table still lists what was found
    assert "cuda:" in out                                     # and why cuda found nothing
    assert "selected: none. WARPLOOP_DEVICE=cuda: no cuda device found" in out
    code, out, _ = run(capsys, "info", "--json")
    data = json.loads(out)
    assert code == 1 and data["selected"] is None and "WARPLOOP_DEVICE=cuda" in data["error"]
    assert "cuda" in data["notes"] and [d["target"] for d in data["devices"]][-1] == "cpu"


def test_info_prints_a_table_and_the_reason_for_its_choice(capsys):
    code, out, _ = run(capsys, "info")
    lines = out.splitlines()
    assert code == 0
    assert lines[0].split() == ["device", "target", "SMs", "memory", "smem/block", "driver"]
    assert any(line.startswith("*") for line in lines[1:])   # the selected device is marked
    selected = next(line for line in lines if line.startswith("selected: "))
    assert ": " in selected.removeprefix("selected: ") and "(" in selected  # target, name, reason


def test_info_json_keeps_its_contract(capsys):
    code, out, _ = run(capsys, "info", "--json")
    data = json.loads(out)
    assert code == 0 and {"devices", "selected", "prebuilt"} <= set(data)
    assert {"backend", "arch", "warp_size"} <= set(data["selected"])
    assert data["selected"]["backend"] in ("cpu", "cuda", "hip")
    # the kernels the package ships compiled: each with its target, dtype and head size, and current
    assert data["prebuilt"] and all({"kind", "target", "dtype", "head_dim", "current"} <= set(p) and p["current"]
                                    for p in data["prebuilt"])


def test_bad_variable_is_one_line_and_debug_shows_the_traceback(capsys, env):
    env(WARPLOOP_DEVICE="gpu")
    code, _, err = run(capsys, "info")
    line = one_line_error(err)
    assert code == 1 and "WARPLOOP_DEVICE='gpu'" in line and "cpu, cuda or hip" in line and "--debug" in line
    with pytest.raises(ValueError, match="WARPLOOP_DEVICE"):
        cli.main(["info", "--debug"])
    env(WARPLOOP_DEBUG="1")
    with pytest.raises(ValueError, match="WARPLOOP_DEVICE"):
        cli.main(["info"])


def test_bundle_build_of_a_file_with_a_syntax_error(capsys, tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import triton\n\ndef broken(:\n    pass\n")
    code, _, err = run(capsys, "bundle", "build", str(bad), "-t", "cpu", "-o", str(tmp_path / "x.wlb"))
    line = one_line_error(err)
    assert code == 1 and f"{bad}, line 3" in line and "invalid syntax" in line


@pytest.mark.parametrize("target", ["cuda:7", "cuda:sm_86", "hip:gfx803", "tpu"])
def test_bundle_build_rejects_targets_with_the_list_of_valid_ones(capsys, tmp_path, target):
    code, _, err = run(capsys, "bundle", "build", str(KERNELS), "-t", "cpu", "-t", target,
                       "-o", str(tmp_path / "x.wlb"))
    line = one_line_error(err)
    assert code == 2 and f"-t {target}:" in line and ", ".join(BUILD_TARGETS) in line
    assert not (tmp_path / "x.wlb").exists()


def test_bundle_build_counts_agree_and_draws_no_bar_off_a_terminal(capsys, tmp_path):
    code, _, err = run(capsys, "bundle", "build", str(KERNELS), "-t", "cuda:80", "-t", "cpu", "-k", "add",
                       "-k", "gelu", "-o", str(tmp_path / "x.wlb"))
    assert code == 0 and "\r" not in err and "it/s" not in err and "variant/s" not in err
    first, last = err.strip().splitlines()
    # add has two exports and gelu one: 3 GPU variants compiled, 3 cpu variants, 6 written
    assert first.startswith("compiling 3 GPU variants") and "3 cpu variants" in first
    assert "2 kernels, 6 variants (3 compiled + 3 cpu source)" in last


@pytest.mark.parametrize("argv", [["bench", "bundle", "--repeats", "0"], ["bench", "decode", "--steps", "0"],
                                  ["bench", "decode", "--repeats", "-1"], ["serve", "--max-num-seqs", "0"],
                                  ["bench", "runtime", "--layers", "0"],
                                  ["bundle", "build", "k.py", "-t", "cpu", "-o", "k.wlb", "-j", "0"]])
def test_counts_must_be_positive(capsys, argv):
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    line = one_line_error(capsys.readouterr().err)
    assert exit_.value.code == 2 and argv[-2].lstrip("-") in line and "positive integer" in line


def test_bench_decode_steps_past_the_engines_context_are_refused_before_any_model(capsys):
    """It measured every system into a traceback each (the engine refused the request) and printed a
    JSON of errors."""
    with pytest.raises(SystemExit) as exit_:
        cli.main(["bench", "decode", "--steps", "100000", "--json"])
    assert "--steps 100000" in str(exit_.value.code) and "give at most 2015" in str(exit_.value.code)
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("value", ["65536", "-1", "http"])
def test_serve_port_out_of_range_is_a_usage_error_naming_the_flag(capsys, value):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["serve", "--port", value])
    line = one_line_error(capsys.readouterr().err)
    assert exit_.value.code == 2 and "--port" in line and value in line


def test_bundle_build_into_a_missing_folder_names_the_flag(capsys, tmp_path):
    out = tmp_path / "no" / "such" / "x.wlb"
    code, _, err = run(capsys, "bundle", "build", str(KERNELS), "-t", "cpu", "-o", str(out))
    line = one_line_error(err)
    assert code == 2 and f"-o {out}: folder {out.parent} does not exist" in line


def test_chat_flag_on_a_model_without_a_template_names_the_flag(capsys, tmp_path):
    import shutil

    tiny = Path(__file__).resolve().parents[1] / "warploop" / "llm" / "tiny"
    model = tmp_path / "plain"
    shutil.copytree(tiny, model)
    config_file = model / "tokenizer_config.json"
    config_file.write_text(json.dumps({k: v for k, v in json.loads(config_file.read_text()).items()
                                       if k != "chat_template"}))
    code, out, err = run(capsys, "generate", "--model", str(model), "--prompt", "hi", "--chat", "--device", "cpu")
    line = one_line_error(err)
    assert code == 2 and out == "" and line.endswith(f"--chat: {model} has no chat template; drop --chat")
