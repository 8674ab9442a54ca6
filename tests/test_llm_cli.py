"""`warploop generate`: JSON keys, streamed text, clear errors."""
from __future__ import annotations

import json

import pytest
from llm_helpers import make_model_dir

from warploop import cli
from warploop.llm import loader


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path, _ = make_model_dir(tmp_path_factory.mktemp("cli"), "llama", initializer_range=0.3)
    return path


def generate(capsys, *args: str) -> tuple[int, str, str]:
    code = cli.main(["generate", "--device", "cpu", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_json_output_has_the_contract_keys_and_names_the_backend(model_dir, capsys):
    code, out, _ = generate(capsys, "--model", str(model_dir), "--prompt", "hello", "--max-tokens", "6", "--json")
    assert code == 0
    data = json.loads(out)
    assert set(data) == {"text", "token_ids", "ttft_ms", "ms_per_token", "backend"}
    assert data["backend"] == "torch"       # the CPU's default
    assert len(data["token_ids"]) == 6 and all(isinstance(t, int) for t in data["token_ids"])
    assert data["ttft_ms"] > 0 and data["ms_per_token"] > 0


def test_streams_the_same_text_as_json(model_dir, capsys):
    args = ["--model", str(model_dir), "--prompt", "hello", "--max-tokens", "10", "--temperature", "0.9",
            "--top-p", "0.9", "--top-k", "50", "--seed", "3"]
    _, out, _ = generate(capsys, *args, "--json")
    code, streamed, _ = generate(capsys, *args)
    assert code == 0
    assert streamed == json.loads(out)["text"] + "\n"


def test_chat_flag_uses_the_template(model_dir, capsys):
    code, out, _ = generate(capsys, "--model", str(model_dir), "--prompt", "hi", "--chat", "--max-tokens", "3",
                            "--json")
    assert code == 0 and len(json.loads(out)["token_ids"]) == 3


def test_errors_are_one_clear_line(model_dir, tmp_path, capsys, monkeypatch):
    code, _, err = generate(capsys, "--model", str(tmp_path / "absent"), "--prompt", "x")
    assert code == 2 and "does not exist" in err and "Traceback" not in err
    code, _, err = generate(capsys, "--model", str(model_dir), "--prompt", "x", "--temperature", "-1")
    assert code == 2 and "temperature" in err
    code, _, err = generate(capsys, "--model", str(model_dir), "--prompt", "x" * 600, "--max-tokens", "8")
    assert code == 2 and "context" in err
    # a prompt that fits, and more tokens than the context leaves: the flag and how many fit
    code, _, err = generate(capsys, "--model", str(model_dir), "--prompt", "x", "--max-tokens", "100000")
    assert code == 2 and "--max-tokens (100000)" in err and "ask for at most" in err
    # a file where the directory goes (config.json itself): says so, and names its folder
    code, _, err = generate(capsys, "--model", str(model_dir / "config.json"), "--prompt", "x")
    assert code == 2 and "is a file, not a model directory" in err and str(model_dir) in err
    monkeypatch.setattr(loader, "TINY_DIR", tmp_path / "tiny")
    code, _, err = generate(capsys, "--model", "tiny", "--prompt", "x")
    assert code == 2 and "embedded tiny model is missing" in err


def test_default_backend_is_the_stream_on_hopper_for_bfloat16(monkeypatch):
    """No --backend: on an NVIDIA GPU of compute capability 9.x (where it was measured) the streaming
    executor for bfloat16 models and the megakernel for other dtypes; torch on the CPU, on ROCm and on
    other NVIDIA GPUs; a named backend is kept, a bad one refused."""
    import torch

    from warploop.llm.build import check_backend, default_backend
    from warploop.llm.config import ModelConfig
    biased = ModelConfig(family="llama", vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=16, mlp_bias=True)   # not a stream model

    assert default_backend(None) == default_backend("cpu") == check_backend(None, torch.device("cpu")) == "torch"
    monkeypatch.setattr(torch.version, "hip", None)
    for capability, want in (((9, 0), "stream"), ((8, 0), "torch"), ((10, 0), "torch")):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        assert default_backend(torch.device("cuda", 0)) == want, capability
        assert check_backend(None, "cuda", "bfloat16") == want
        assert check_backend(None, "cuda", torch.float32) == ("megakernel" if want == "stream" else want)
        assert check_backend(None, "cuda", "bfloat16", biased) == ("megakernel" if want == "stream" else want)
        assert check_backend("torch", "cuda") == "torch"
    monkeypatch.setattr(torch.version, "hip", "6.2")
    assert default_backend("cuda") == "torch"
    with pytest.raises(ValueError, match="backend 'tensorrt' is not one of torch, megakernel"):
        check_backend("tensorrt", "cuda")
