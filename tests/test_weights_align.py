"""Every weight the kernels read starts at a multiple of 16 bytes, whatever file it came from.

The hole this closes: `save_pretrained` writes a safetensors header whose length leaves tensors 8 bytes
off a 16-byte boundary; memory-mapped as they are (CPU, fp32), the megakernel refused them with
"argument 'table' ... is declared *fp32:16 ... pass an aligned tensor". The user gave a directory,
not a tensor, so `fuse` makes them aligned at load, for every layout (one file, shards, GGUF).
"""
from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from llm_helpers import BOS, EOS, hf_config, save_model, save_tokenizer

from warploop.llm.config import ModelConfig
from warploop.llm.loader import load_weights
from warploop.llm.weights import WEIGHT_ALIGN_BYTES, checkpoint_shapes, fuse

ROOT = Path(__file__).resolve().parents[1]
pytest.importorskip("transformers")


def all_tensors(weights) -> dict[str, torch.Tensor]:
    named = {"embed": weights.embed, "norm": weights.norm, "lm_head": weights.lm_head}
    for i, layer in enumerate(weights.layers):
        for field, value in vars(layer).items():
            if value is not None:
                named[f"layers.{i}.{field}"] = value
    return named


def misaligned_in_file(file: Path) -> list[str]:
    """Names of the tensors whose bytes start off a 16-byte boundary in a safetensors file."""
    header_len = struct.unpack("<Q", file.read_bytes()[:8])[0]
    header = json.loads(file.read_bytes()[8:8 + header_len])
    start = 8 + header_len
    return [name for name, meta in header.items()
            if name != "__metadata__" and (start + meta["data_offsets"][0]) % WEIGHT_ALIGN_BYTES]


@pytest.fixture(scope="module")
def vocab400(tmp_path_factory) -> Path:
    """The model of the report: Llama, fp32, 2 layers, hidden 64, vocabulary 400, save_pretrained."""
    path = tmp_path_factory.mktemp("vocab400")
    save_model(path, hf_config("llama", vocab_size=400, bos_token_id=BOS, eos_token_id=EOS))
    return path


def test_the_saved_file_has_misaligned_tensors(vocab400):
    """The precondition of the tests below: the file really puts tensors at an 8-byte offset."""
    assert misaligned_in_file(vocab400 / "model.safetensors")


def test_fuse_copies_only_the_misaligned(vocab400):
    cfg = ModelConfig.from_dir(str(vocab400))
    shapes = checkpoint_shapes(cfg)
    gen = torch.Generator().manual_seed(0)
    state, off_by_8 = {}, set()
    for i, (name, shape) in enumerate(shapes.items()):
        n = int(torch.Size(shape).numel())
        if i % 2:  # every other tensor starts 8 bytes into its buffer
            state[name] = torch.randn(n + 2, generator=gen)[2:].view(shape)
            off_by_8.add(name)
        else:
            state[name] = torch.randn(shape, generator=gen)
    assert all(state[n].data_ptr() % WEIGHT_ALIGN_BYTES == 8 for n in off_by_8)
    weights = fuse(cfg, state.__getitem__, "cpu", torch.float32)
    for name, t in all_tensors(weights).items():
        assert t.data_ptr() % WEIGHT_ALIGN_BYTES == 0, name
    # An aligned tensor taken as it is (no fused concatenation) is not copied; a misaligned one is, equal.
    assert weights.embed.data_ptr() == state["model.embed_tokens.weight"].data_ptr()
    assert weights.norm.data_ptr() != state["model.norm.weight"].data_ptr()
    assert torch.equal(weights.norm, state["model.norm.weight"])


def test_single_file_loads_aligned(vocab400):
    cfg = ModelConfig.from_dir(str(vocab400))
    weights = load_weights(vocab400, cfg, "cpu", torch.float32, progress=False)
    for name, t in all_tensors(weights).items():
        assert t.data_ptr() % WEIGHT_ALIGN_BYTES == 0, name


def test_sharded_checkpoint_loads_aligned(vocab400, tmp_path):
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(vocab400, dtype=torch.float32)
    hf.save_pretrained(tmp_path, max_shard_size="50KB")
    save_tokenizer(tmp_path)
    shards = sorted(tmp_path.glob("*.safetensors"))
    assert len(shards) > 1 and any(misaligned_in_file(f) for f in shards)
    cfg = ModelConfig.from_dir(str(tmp_path))
    weights = load_weights(tmp_path, cfg, "cpu", torch.float32, progress=False)
    for name, t in all_tensors(weights).items():
        assert t.data_ptr() % WEIGHT_ALIGN_BYTES == 0, name


def test_gguf_loads_aligned(tmp_path):
    pytest.importorskip("gguf")
    from gguf_writer import write_tiny_gguf

    from warploop.llm.gguf import GGUFModel

    path = write_tiny_gguf(tmp_path / "tiny.gguf", {"": "F32"})
    weights = GGUFModel(path).load_weights("cpu", torch.float32)
    for name, t in all_tensors(weights).items():
        assert t.data_ptr() % WEIGHT_ALIGN_BYTES == 0, name


def test_transformers_directory_generates_on_the_megakernel_cpu(vocab400, tmp_path):
    """The report's command, end to end: `warploop generate --backend megakernel` on the CPU."""
    model = tmp_path / "model"
    shutil.copytree(vocab400, model)
    env = dict(os.environ, WARPLOOP_DEVICE="cpu")
    run = subprocess.run([sys.executable, "-m", "warploop.cli", "generate", "--model", str(model), "--prompt", "hi",
                          "--max-tokens", "4", "--backend", "megakernel", "--json"],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["backend"] == "megakernel" and len(out["token_ids"]) == 4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("backend, dtype", [("torch", "float32"), ("stream", "bfloat16")])
def test_transformers_directory_generates_on_each_gpu_backend(vocab400, tmp_path, backend, dtype):
    """The same directory on the GPU, per op and on the streaming kernel (Hopper, bf16): the weights
    reach the device aligned, and greedy tokens come. (The megakernel's resident kernel would
    compile here for minutes: the CPU test above runs it on this directory.)"""
    if backend == "stream" and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the streaming executor needs a Hopper GPU")
    model = tmp_path / "model"
    shutil.copytree(vocab400, model)
    env = dict(os.environ, WARPLOOP_DEVICE="cuda")
    run = subprocess.run([sys.executable, "-m", "warploop.cli", "generate", "--model", str(model), "--prompt", "hi",
                          "--max-tokens", "4", "--backend", backend, "--dtype", dtype, "--json"],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["backend"] == backend and len(out["token_ids"]) == 4
