"""Malformed and hostile model directories: each gives one error of the project's own type that
names the file or field and the fix, before anything large is allocated."""
from __future__ import annotations

import json
import shutil
import time

import pytest
import torch
from llm_helpers import engine_for, make_model_dir

from warploop.llm.config import ConfigError, ModelConfig
from warploop.llm.loader import ModelLoadError
from warploop.llm.tokenizer import Tokenizer, TokenizerError


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("hostile"), "llama")[0]


@pytest.fixture
def path(model, tmp_path):
    target = tmp_path / "model"
    shutil.copytree(model, target)
    return target


def edit_config(path, **changes):
    raw = json.loads((path / "config.json").read_text())
    raw.update(changes)
    (path / "config.json").write_text(json.dumps(raw))


def weights_file(path):
    return next(path.glob("*.safetensors"))


def rewrite_tensors(path, change):
    from safetensors.torch import load_file, save_file

    file = weights_file(path)
    tensors = load_file(file)
    change(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


@pytest.mark.parametrize("cut", [0, 0.5])
def test_empty_or_truncated_safetensors(path, cut):
    file = weights_file(path)
    data = file.read_bytes()
    file.write_bytes(data[:int(len(data) * cut)])
    with pytest.raises(ModelLoadError, match=rf"{file.name}.*(truncated|empty).*download"):
        engine_for(path)


def test_corrupt_tokenizer_json(path):
    (path / "tokenizer.json").write_text('{"model": {"type": "BPE", "vocab": ')
    with pytest.raises(TokenizerError, match=r"tokenizer\.json is not a valid tokenizer file"):
        engine_for(path)


def test_tokenizer_config_that_is_a_list(path):
    (path / "tokenizer_config.json").write_text("[1, 2]")
    with pytest.raises(TokenizerError, match=r"tokenizer_config\.json must hold a JSON object"):
        Tokenizer(path)


@pytest.mark.parametrize("changes,message", [
    ({"hidden_size": None}, r"hidden_size must be a positive integer, got None"),
    ({"hidden_size": "64"}, r"hidden_size must be a positive integer, got '64'"),
    ({"num_attention_heads": 0}, r"num_attention_heads must be a positive integer, got 0"),
    ({"rms_norm_eps": -1}, r"rms_norm_eps must be a finite number in \(0, 1\), got -1"),
    ({"rms_norm_eps": float("nan")}, r"rms_norm_eps must be a finite number in \(0, 1\), got nan"),
    ({"rope_parameters": [1, 2]}, r"rope_parameters must be a JSON object"),
    ({"architectures": "LlamaForCausalLM"}, r"architectures must be a list"),
])
def test_malformed_config_field(path, changes, message):
    edit_config(path, **changes)
    with pytest.raises(ModelLoadError, match=rf"config\.json.*{message}"):
        engine_for(path)


def test_config_that_is_a_list(path):
    (path / "config.json").write_text("[1, 2, 3]")
    with pytest.raises(ModelLoadError, match=r"config\.json must hold a JSON object, got a list"):
        engine_for(path)
    with pytest.raises(ConfigError, match="must hold a JSON object"):
        ModelConfig.from_dict([1, 2, 3])


def test_ten_million_layers_refused_before_allocating(path):
    edit_config(path, num_hidden_layers=10**7)
    start = time.perf_counter()
    with pytest.raises(ModelLoadError, match=r"num_hidden_layers is 10000000 in config\.json but the checkpoint "
                                             r"has 2 layers"):
        engine_for(path)
    assert time.perf_counter() - start < 10


def test_nan_weights_name_the_tensor(path):
    def poison(tensors):
        tensors["model.layers.1.mlp.down_proj.weight"][3, 5] = float("nan")
    rewrite_tensors(path, poison)
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.mlp\.down_proj\.weight.*NaN or infinite"):
        engine_for(path)


def test_weights_that_overflow_float16_are_refused(path):
    def huge(tensors):
        tensors["model.norm.weight"][0] = 1e6
    rewrite_tensors(path, huge)
    with pytest.raises(ModelLoadError, match=r"model\.norm\.weight.*NaN or infinite.*float16"):
        engine_for(path, dtype="float16")


@pytest.mark.parametrize("dtype,code", [(torch.int8, "I8"), (torch.bool, "BOOL")])
def test_integer_or_bool_weights_in_a_float_model(path, dtype, code):
    def retype(tensors):
        name = "model.layers.0.self_attn.k_proj.weight"
        tensors[name] = tensors[name].to(dtype)
    rewrite_tensors(path, retype)
    with pytest.raises(ModelLoadError, match=rf"model\.layers\.0\.self_attn\.k_proj\.weight .*stored as {code}"):
        engine_for(path)


# --- chat templates: model-supplied code, rendered sandboxed and bounded ----------------------

HI = [{"role": "user", "content": "hi"}]


def with_template(path, template):
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return Tokenizer(path)


@pytest.mark.parametrize("template,message", [
    ("{{ raise_exception('roles must alternate') }}", "rejected the messages: roles must alternate"),
    ("{{ 1 / 0 }}", "failed: ZeroDivisionError"),
    ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "recursed too deeply"),
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
     "more than 1000000 range items"),
    ("{{ 'x' * 10**9 }}", "power 9|longer than"),
    ("{{ 'x' * 100000000 }}", "longer than 16777216 items"),
    ("{% for i in range(900) %}{{ 'y' * 99999 }}{% endfor %}", "output exceeds 16777216 characters"),
    ("{% if %}", "rejected the messages"),
    ("{{ ''.__class__.__mro__ }}", "rejected the messages|failed"),
])
def test_chat_template_failures_are_one_clear_error(path, template, message):
    tok = with_template(path, template)
    start = time.perf_counter()
    with pytest.raises(TokenizerError, match=message):
        tok.apply_chat_template(HI)
    assert time.perf_counter() - start < 6


def test_chat_template_of_the_wrong_type(path):
    with pytest.raises(TokenizerError, match="chat_template .* must be a string"):
        with_template(path, 5)


def test_bounded_template_still_renders_normal_chats(path):
    tok = with_template(path, "{% for m in messages %}{{ loop.index }}{{ m['content'] * 2 }}"
                              "{% endfor %}{% for i in range(3) %}.{% endfor %}")
    assert tok.apply_chat_template(HI * 3) == "1hihi2hihi3hihi..."


def test_chat_template_loop_over_strings_is_stopped_at_the_deadline(path, monkeypatch):
    from warploop.llm import chat_template

    monkeypatch.setattr(chat_template, "MAX_SECONDS", 0.5)
    tok = with_template(path, "{% for a in 'x' * 100000 %}{% for b in 'y' * 100000 %}{% endfor %}{% endfor %}")
    start = time.perf_counter()
    with pytest.raises(TokenizerError, match=r"ran longer than 0\.5 s"):
        tok.apply_chat_template(HI)
    assert time.perf_counter() - start < 3
    time.sleep(0.7)  # past the deadline: a stray interrupt would land here, in the caller
    assert with_template(path, "{{ messages[0]['content'] }}").apply_chat_template(HI) == "hi"


def test_watchdog_never_fires_into_the_caller_after_a_render(path, monkeypatch):
    from warploop.llm import chat_template

    monkeypatch.setattr(chat_template, "MAX_SECONDS", 0.001)  # deadlines expiring around the render's end
    tok = with_template(path, "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    outcomes = set()
    for _ in range(300):
        try:
            outcomes.add(tok.apply_chat_template(HI))
        except TokenizerError as e:
            outcomes.add("stopped" if "ran longer" in str(e) else str(e))
        sum(range(2000))  # Python work right after the render, where an undelivered interrupt would land
    assert outcomes <= {"hi", "stopped"}
