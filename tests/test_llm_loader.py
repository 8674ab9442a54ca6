"""Model directories: sharded checkpoints, dtypes, tokenizer and chat template, and clear errors."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from llm_helpers import BOS, EOS, engine_for, make_model_dir

from warploop.llm import loader
from warploop.llm.config import ModelConfig
from warploop.llm.loader import ModelLoadError, load_config, load_weights, resolve_model_dir
from warploop.llm.params import SamplingParams
from warploop.llm.tokenizer import Tokenizer, TokenizerError

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("loader"), "llama", initializer_range=0.3)


def copy(model_dir, tmp_path):
    target = tmp_path / "model"
    shutil.copytree(model_dir, target)
    return target


def test_sharded_checkpoint_loads_the_same(model, tmp_path):
    path, hf = model
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="50KB")
    shutil.copy(path / "tokenizer.json", tmp_path / "sharded")
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 1
    with engine_for(path) as one, engine_for(tmp_path / "sharded") as many:
        assert one.generate([BOS, 1, 2], GREEDY).token_ids == many.generate([BOS, 1, 2], GREEDY).token_ids


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_runs_close_to_fp32(model, dtype):
    path, _ = model
    cfg = load_config(path)
    w32 = load_weights(path, cfg, torch.device("cpu"), torch.float32, progress=False)
    w16 = load_weights(path, cfg, torch.device("cpu"), getattr(torch, dtype), progress=False)
    assert w16.layers[0].qkv.dtype == getattr(torch, dtype)
    assert torch.allclose(w16.layers[0].qkv.float(), w32.layers[0].qkv, atol=1e-2)
    with engine_for(path, dtype=dtype) as engine:
        assert len(engine.generate([BOS, 1, 2], GREEDY).token_ids) == 8


def test_missing_directory_and_files(tmp_path, model):
    with pytest.raises(ModelLoadError, match="does not exist"):
        resolve_model_dir(str(tmp_path / "nowhere"))
    with pytest.raises(ModelLoadError, match="no config.json"):
        resolve_model_dir(str(tmp_path))
    path = copy(model[0], tmp_path)
    for f in path.glob("*.safetensors"):
        f.unlink()
    (path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ModelLoadError, match=r"no \.safetensors weights .*pytorch_model\.bin"):
        engine_for(path)


def test_missing_tiny_model_says_how_to_fix(monkeypatch, tmp_path):
    monkeypatch.setattr(loader, "TINY_DIR", tmp_path / "tiny")
    with pytest.raises(ModelLoadError, match="embedded tiny model is missing.*--model DIR"):
        resolve_model_dir("tiny")


def test_unknown_architecture(tmp_path, model):
    path = copy(model[0], tmp_path)
    raw = json.loads((path / "config.json").read_text())
    raw.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelLoadError, match="unknown architecture 'GPT2LMHeadModel'.*LlamaForCausalLM"):
        engine_for(path)


def test_mismatched_shapes_name_the_tensor(tmp_path, model):
    path = copy(model[0], tmp_path)
    raw = json.loads((path / "config.json").read_text())
    raw["intermediate_size"] = 96
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelLoadError, match=r"mlp\.gate_proj\.weight has shape \(128, 64\).*implies \(96, 64\)"):
        engine_for(path)


def test_missing_tensor_and_missing_shard(tmp_path, model):
    from safetensors.torch import load_file, save_file

    path = copy(model[0], tmp_path)
    file = next(path.glob("*.safetensors"))
    tensors = load_file(file)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"lacks model\.layers\.1\.mlp\.up_proj\.weight"):
        engine_for(path)
    index = {"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelLoadError, match="model-00002-of-00002.safetensors"):
        engine_for(path)


def test_unsupported_config_features():
    base = json.loads(json.dumps({"architectures": ["Qwen2ForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
                                  "num_hidden_layers": 1, "vocab_size": 10, "intermediate_size": 8}))
    assert ModelConfig.from_dict(base).qkv_bias
    with pytest.raises(ValueError, match="sliding-window"):
        ModelConfig.from_dict({**base, "use_sliding_window": True})
    with pytest.raises(ValueError, match="hidden_act 'gelu'"):
        ModelConfig.from_dict({**base, "hidden_act": "gelu"})
    with pytest.raises(ValueError, match="rope_type 'dynamic'"):
        ModelConfig.from_dict({**base, "rope_scaling": {"type": "dynamic", "factor": 2.0}})
    with pytest.raises(ValueError, match="lacks 'vocab_size'"):
        ModelConfig.from_dict({k: v for k, v in base.items() if k != "vocab_size"})


def test_tokenizer_chat_template_and_special_tokens(model):
    tok = Tokenizer(model[0])
    assert tok.eos_token_ids == {EOS}
    ids = tok.encode("hi")
    assert ids[0] == BOS and tok.decode(ids) == "hi"
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == "<s><|user|>hi\n<|assistant|>"
    assert tok.encode(text).count(BOS) == 1  # the template's BOS is not doubled


def test_missing_chat_template_is_a_clear_error(tmp_path, model):
    path = copy(model[0], tmp_path)
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    with pytest.raises(TokenizerError, match="no chat template"):
        Tokenizer(path).apply_chat_template([{"role": "user", "content": "hi"}])
