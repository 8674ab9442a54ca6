"""Loading a model into an engine's parts: tokenizer, config, weights on a device, a backend over a
KV pool (warploop.llm.build), or a tensor-parallel backend over N ranks (warploop.llm.tp). What
Engine.from_model runs before the engine starts; it knows nothing of the engine itself.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from warploop.llm.build import build_backend, torch_device, torch_dtype
from warploop.llm.config import ModelConfig
from warploop.llm.engine_config import EngineConfig
from warploop.llm.loader import checkpoint_dtype, load_config, load_weights, open_gguf, resolve_model_dir
from warploop.llm.tokenizer import Tokenizer
from warploop.llm.tp.build import RankJob, build_tp_backend


@dataclass
class ModelParts:
    cfg: ModelConfig
    backend: object          # a warploop.llm.backend.Backend
    tokenizer: Tokenizer
    name: str                # the model's name in responses: tiny, a directory's or a file's
    max_context: int
    start_s: dict[str, float] = field(default_factory=dict)   # seconds: load (weights on the device), backend


def load_parts(model: str, config: EngineConfig) -> ModelParts:
    """The parts of an engine for `tiny`, a Hugging Face-format directory, or a .gguf file (or a
    directory holding one), as `config` says (its checks ran when it was made); with
    tensor_parallel N > 1, over N ranks (N GPUs, or N processes on the CPU), each holding 1/N of
    the model (warploop/llm/tp)."""
    device, dtype, block_size, backend = config.device, config.dtype, config.block_size, config.backend
    num_kv_blocks, max_num_seqs, max_model_len = config.num_kv_blocks, config.max_num_seqs, config.max_model_len
    progress, use_cuda_graphs, tensor_parallel = config.progress, config.use_cuda_graphs, config.tensor_parallel
    t0 = time.perf_counter()
    gguf = open_gguf(model)
    if gguf is not None:
        if tensor_parallel != 1:
            raise ValueError("--tensor-parallel does not load .gguf files yet: convert the model to safetensors")
        cfg, tokenizer, path = gguf.config, gguf.tokenizer(), gguf.path
        dev = torch_device(device)
        torch_type = torch_dtype(dtype, cfg)
    else:
        path = resolve_model_dir(model)
        cfg = load_config(path)
        tokenizer = Tokenizer(path, extra_eos_ids=cfg.eos_token_ids)
        dev = torch_device(device)
        torch_type = torch_dtype(dtype, cfg, checkpoint_dtype(path))
    if tensor_parallel != 1:
        max_len = min(max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        job = RankJob(cfg, str(path), str(torch_type).removeprefix("torch."), block_size, num_kv_blocks, max_num_seqs,
                      max_len, use_cuda_graphs, backend=backend or "torch")
        made, max_context = build_tp_backend(cfg, tensor_parallel, dev, job)
        start_s = {"ranks": time.perf_counter() - t0}
    else:
        weights = (gguf.load_weights(dev, torch_type, progress=progress) if gguf is not None
                   else load_weights(path, cfg, dev, torch_type, progress=progress))
        t1 = time.perf_counter()
        made, max_context = build_backend(cfg, weights, dev, block_size=block_size, num_kv_blocks=num_kv_blocks,
                                          max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                                          use_cuda_graphs=use_cuda_graphs, backend=backend)
        start_s = {"load": t1 - t0, "backend": time.perf_counter() - t1}
    name = "tiny" if model == "tiny" else Path(path).stem if gguf else os.path.basename(os.path.normpath(str(path)))
    return ModelParts(cfg, made, tokenizer, name, max_context, start_s)
