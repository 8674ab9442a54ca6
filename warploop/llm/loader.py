"""Load a Hugging Face-format model directory: config.json and one or many .safetensors files
(GGUF files are read by gguf.py; `open_gguf` is the hook that picks them).

Every tensor the config implies is checked for presence and shape before anything is copied to the
device, so a wrong or truncated checkpoint fails at once with the name of what is wrong.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

from warploop.llm.config import ModelConfig
from warploop.llm.weights import ModelWeights, checkpoint_shapes, fuse

TINY_DIR = Path(__file__).resolve().parent / "tiny"
FLOAT_CODES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}   # safetensors dtype codes we load
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


class ModelLoadError(ValueError):
    """The model directory is missing, incomplete or does not match its config."""


def open_gguf(model: str):
    """A GGUFModel when `model` is a .gguf file or a directory holding one (and no config.json), else None."""
    from warploop.llm.gguf import GGUFModel, find_gguf

    if model == "tiny":
        return None
    path = find_gguf(model)
    return GGUFModel(path) if path is not None else None


def resolve_model_dir(model: str) -> Path:
    """`tiny` -> the embedded model shipped in the package; anything else is a directory path."""
    if model == "tiny":
        if not (TINY_DIR / "config.json").is_file():
            raise ModelLoadError(f"the embedded tiny model is missing from {TINY_DIR}; reinstall warploop, "
                                 "rebuild it with scripts/train_tiny.py, or pass --model DIR")
        return TINY_DIR
    path = Path(model).expanduser()
    if path.is_file():
        raise ModelLoadError(f"{str(path)!r} is a file, not a model directory; pass its folder "
                             f"({str(path.parent)!r}) if it holds a Hugging Face-format model, a .gguf file, or "
                             "--model tiny")
    if not path.is_dir():
        raise ModelLoadError(f"model directory {str(path)!r} does not exist; pass --model tiny or a Hugging "
                             "Face-format directory (config.json, tokenizer.json, *.safetensors)")
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{path} has no config.json; a model directory needs the Hugging Face config.json, "
                             "tokenizer.json and .safetensors weights")
    return path


def load_config(path: str | Path) -> ModelConfig:
    try:
        return ModelConfig.from_dir(str(path))
    except (ValueError, FileNotFoundError) as e:  # the message names config.json
        raise ModelLoadError(str(e)) from None


def safetensors_files(path: Path) -> list[Path]:
    """The weight files: those named by model.safetensors.index.json, else every *.safetensors."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ModelLoadError(f"{index} is malformed ({e}); it needs a 'weight_map' object") from None
        files = [path / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{index.name} names shard(s) that are not in {path}: {', '.join(missing)}; "
                                 "download the missing files")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        others = [p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth")]
        ggufs = [p.name for p in path.iterdir() if p.suffix == ".gguf"]
        hint = f" (found {', '.join(others)}: convert them to safetensors)" if others else ""
        hint += f" (found {', '.join(ggufs)}: pass that file as --model)" if ggufs else ""
        raise ModelLoadError(f"no .safetensors weights in {path}{hint}")
    return files


def _open(file: Path):
    from safetensors import safe_open

    if file.stat().st_size == 0:
        raise ModelLoadError(f"{file} is empty; download it again")
    try:
        return safe_open(str(file), framework="pt", device="cpu")
    except Exception as e:  # safetensors raises its own error types for truncated or corrupt headers
        raise ModelLoadError(f"cannot read {file}: {e}; the file is truncated or corrupt: download it again") from None


def _check_layers(path: Path, cfg: ModelConfig, names) -> None:
    """The config's layer count against the checkpoint's, before anything is sized by it."""
    found = {int(m.group(1)) for name in names if (m := _LAYER.match(name))}
    if len(found) != cfg.num_layers:
        raise ModelLoadError(f"num_hidden_layers is {cfg.num_layers} in config.json but the checkpoint has "
                             f"{len(found)} layers; fix num_hidden_layers in {path / 'config.json'} or use the "
                             "matching weights")


def load_weights(path: str | Path, cfg: ModelConfig, device, dtype, progress: bool = True) -> ModelWeights:
    """Read, check and fuse the checkpoint's tensors onto `device` in `dtype`.

    Checked before anything is copied: the layer count, each tensor's presence, shape and dtype
    (float only); checked on the device after conversion: every tensor is finite.
    """
    path = Path(path)
    where = {}
    for file in safetensors_files(path):
        handle = _open(file)
        for name in handle.keys():
            where[name] = (handle, file)
    _check_layers(path, cfg, where)
    expected = checkpoint_shapes(cfg)
    missing = [n for n in expected if n not in where]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise ModelLoadError(f"the checkpoint in {path} lacks {', '.join(missing[:3])}{more}; "
                             "the weights are incomplete or belong to another architecture")
    for name, shape in expected.items():
        handle, file = where[name]
        tensor = handle.get_slice(name)
        actual = tuple(tensor.get_shape())
        if actual != shape:
            raise ModelLoadError(f"{name} has shape {actual} in the checkpoint but config.json implies {shape}; "
                                 f"the config and the weights in {path} do not match")
        if tensor.get_dtype() not in FLOAT_CODES:
            raise ModelLoadError(f"{name} in {file.name} is stored as {tensor.get_dtype()}; warploop loads float "
                                 f"weights ({', '.join(FLOAT_CODES)}): use an unquantized checkpoint")
    try:
        return fuse(cfg, lambda name: where[name][0].get_tensor(name), device, dtype, progress=progress,
                    check_finite=True)
    except ValueError as e:  # non-finite weights, named by fuse
        raise ModelLoadError(f"{path}: {e}") from None


def checkpoint_dtype(path: str | Path) -> str | None:
    """The dtype of the first floating tensor in the checkpoint (used when config.json names none)."""
    with _open(safetensors_files(Path(path))[0]) as handle:
        for name in handle.keys():
            code = handle.get_slice(name).get_dtype()
            if code in FLOAT_CODES:
                return FLOAT_CODES[code]
    return None
