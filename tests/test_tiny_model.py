"""The embedded `--model tiny` directory: standard HF Llama format, small, and it writes Python."""

from __future__ import annotations

import json
import pathlib
import re

import pytest

TINY = pathlib.Path(__file__).resolve().parents[1] / "warploop" / "llm" / "tiny"
FILES = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]


@pytest.fixture(scope="module")
def config() -> dict:
    return json.loads((TINY / "config.json").read_text())


@pytest.fixture(scope="module")
def hf():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(TINY)
    model = transformers.AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32).eval()
    return tok, model


def greedy(hf, prompt: str, n: int = 24, add_special_tokens: bool = True) -> str:
    tok, model = hf
    ids = tok(prompt, return_tensors="pt", add_special_tokens=add_special_tokens).input_ids
    out = model.generate(ids, max_new_tokens=n, do_sample=False)
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=False)


def test_directory_is_complete_and_small():
    missing = [f for f in FILES if not (TINY / f).is_file()]
    assert not missing, f"missing {missing}: rebuild with scripts/train_tiny.py"
    total = sum(p.stat().st_size for p in TINY.iterdir())
    assert total < 20 * 2**20, f"tiny model is {total / 2**20:.1f} MiB, over the 20 MiB limit"


def test_config_is_a_sane_llama(config):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(TINY / "tokenizer.json"))
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert config["vocab_size"] == tok.get_vocab_size()
    assert config["hidden_size"] % config["num_attention_heads"] == 0
    assert config["num_attention_heads"] % config["num_key_value_heads"] == 0
    assert config["tie_word_embeddings"] is True
    assert 256 <= config["max_position_embeddings"] <= 4096
    assert config["bos_token_id"] == tok.token_to_id("<|bos|>")
    assert set(config["eos_token_id"]) == {tok.token_to_id("<|eos|>"), tok.token_to_id("<|im_end|>")}
    gen = json.loads((TINY / "generation_config.json").read_text())
    assert gen["eos_token_id"] == config["eos_token_id"]


def test_weights_match_config(config):
    from safetensors import safe_open

    h, inter = config["hidden_size"], config["intermediate_size"]
    kv = config["num_key_value_heads"] * config.get("head_dim", h // config["num_attention_heads"])
    with safe_open(str(TINY / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert f.get_slice("model.embed_tokens.weight").get_shape() == [config["vocab_size"], h]
        for i in range(config["num_hidden_layers"]):
            p = f"model.layers.{i}."
            assert f.get_slice(p + "self_attn.k_proj.weight").get_shape() == [kv, h]
            assert f.get_slice(p + "mlp.down_proj.weight").get_shape() == [h, inter]
        dtypes = {f.get_slice(n).get_dtype() for n in names}
    assert "lm_head.weight" not in names, "embeddings are tied: lm_head must not be stored"
    assert dtypes == {"BF16"}


def test_tokenizer_round_trips_python_and_adds_bos():
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(TINY / "tokenizer.json"))
    src = "import os\n\n\nclass Path:\n    def __init__(self, name):\n        self.name = os.fspath(name)  # ünï\n"
    ids = tok.encode(src).ids
    assert ids[0] == tok.token_to_id("<|bos|>")
    assert tok.decode(ids, skip_special_tokens=True) == src
    assert len(ids) < len(src) / 2.5, f"{len(ids)} tokens for {len(src)} characters: BPE should compress Python well"
    # A prompt ending in a space must split as training text did: "import " is one token.
    assert tok.encode("import ", add_special_tokens=False).tokens == ["importĠ"]


def test_chat_template_renders_llama3_style():
    import jinja2

    template = json.loads((TINY / "tokenizer_config.json").read_text())["chat_template"]
    text = jinja2.Template(template).render(messages=[{"role": "user", "content": "hi"}],
                                            add_generation_prompt=True, bos_token="<|bos|>")
    assert text == "<|bos|><|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_greedy_continuations_look_like_python(hf):
    imp = greedy(hf, "import ")
    assert re.match(r"[A-Za-z_][\w.]*( as \w+)?(, \w+)*\n", imp), imp
    fn = greedy(hf, "def ")
    assert re.match(r"[A-Za-z_]\w*\(", fn), fn
    body = greedy(hf, "class Stack:\n    def __init__(self):\n        ")
    assert re.match(r"self\.\w+ = ", body), body
    main = greedy(hf, "if __name__ == ")
    assert re.match(r"""['"]__main__['"]:\n""", main), main


def test_chat_answer_is_a_function_and_stops(hf):
    tok, _ = hf
    prompt = tok.apply_chat_template([{"role": "user", "content": "Write a Python function named escape."}],
                                     tokenize=False, add_generation_prompt=True)
    answer = greedy(hf, prompt, 96, add_special_tokens=False)
    assert answer.startswith("def escape("), answer
    assert answer.endswith("<|im_end|>"), "the model should end its answer with <|im_end|>: " + answer
