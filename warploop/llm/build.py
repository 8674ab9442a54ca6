"""Putting an engine together: device and dtype, weights, KV cache size, backend.

The KV pool is sized from memory when not given: on a GPU, most of what is free after the
weights; on the CPU, a bounded amount. The context the engine accepts is the model's, capped by
`max_model_len` and by what the pool can hold for one sequence.
"""
from __future__ import annotations

from warploop.llm.config import ModelConfig
from warploop.llm.kv_cache import KVCacheLayout, cdiv
from warploop.llm.stream_pools import pack_pools
from warploop.llm.stream_step import unsupported as unsupported_stream

GPU_KV_FRACTION = 0.8            # of the memory free after loading weights
GPU_RESERVE = 2 << 30            # activations, CUDA graphs, the sampler's [batch, vocab] buffers
CPU_KV_BYTES = 512 << 20
BACKENDS = ("torch", "megakernel", "stream")
BACKEND_HELP = ("stream: the streaming executor (the default on a Hopper GPU, H100/H200, for bfloat16 models: "
                "batch-1 decode and greedy decode loops inside one resident kernel, larger batches per op), the "
                "decode megakernel (the default there for other dtypes: batch 1 on its graph), or per-op torch "
                "(the default elsewhere)")


def torch_device(device: str | None):
    """The torch device for WARPLOOP_DEVICE / `device` (cpu, cuda, hip; None probes)."""
    import torch

    from warploop.target import select_device

    info = select_device(device)
    if info.target.backend == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError(f"the {info.target.backend} device {info.name!r} is visible but this torch build "
                           f"({torch.__version__}) cannot use it; install a CUDA or ROCm build of torch, or pass "
                           "device='cpu'")
    return torch.device("cuda", info.index)


def torch_dtype(name: str | None, cfg: ModelConfig, fallback: str | None = None):
    import torch

    name = name or cfg.dtype or fallback or "float32"
    try:
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]
    except KeyError:
        raise ValueError(f"dtype {name!r} is not supported; use float32, bfloat16 or float16") from None


def kv_blocks_for(layout_without_blocks: KVCacheLayout, device, max_num_seqs: int, max_len: int,
                  reserve_bytes: int = 0) -> int:
    """Enough blocks for every sequence at full length, or what memory allows once `reserve_bytes`
    more (a backend's own copy of the weights) are set aside."""
    import torch

    want = max_num_seqs * cdiv(max_len, layout_without_blocks.block_size)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = int((free - GPU_RESERVE - reserve_bytes) * GPU_KV_FRACTION)
    else:
        budget = CPU_KV_BYTES
    return max(1, min(want, budget // layout_without_blocks.bytes_per_block))


def check_backend(name: str | None, device=None, dtype=None, cfg: ModelConfig | None = None) -> str:
    """The backend's name: 'torch' (per-op), 'megakernel' or 'stream'; None picks the default for `device` (a
    torch device; None: the CPU's) and the model (its `dtype` and `cfg`), default_backend."""
    if name is None:
        return default_backend(device, dtype, cfg)
    if name not in BACKENDS:
        raise ValueError(f"backend {name!r} is not one of {', '.join(BACKENDS)} (--backend)")
    return name


def default_backend(device, dtype=None, cfg: ModelConfig | None = None) -> str:
    """On an NVIDIA Hopper GPU (compute capability 9.x: the H100 and H200): 'stream', the streaming
    executor, for a bfloat16 model it runs (dtype None: the bench models' bfloat16; cfg None: any),
    where it was measured faster than the megakernel and torch.compile at batch 1 on Llama-3.2-1B and
    Qwen3-0.6B shapes (BENCHMARKS.md, Decode); 'megakernel' for the rest (stream_step.unsupported says
    why). 'torch'
    elsewhere: the CPU (both graphs run there as references, not speeds), ROCm (compiled for gfx942,
    never run on one here) and other NVIDIA GPUs (not measured yet). `--backend` picks any of them."""
    import torch

    if device is None or torch.device(device).type != "cuda" or torch.version.hip:
        return "torch"
    if torch.cuda.get_device_capability(torch.device(device))[0] != 9:
        return "torch"
    dtype = "bfloat16" if dtype is None else str(dtype).removeprefix("torch.")
    if cfg is not None:
        return "megakernel" if unsupported_stream(cfg, dtype) else "stream"
    return "stream" if dtype == "bfloat16" else "megakernel"


def build_backend(cfg: ModelConfig, weights, device, *, block_size: int = 16, num_kv_blocks: int | None = None,
                  max_num_seqs: int = 32, max_model_len: int | None = None, use_cuda_graphs: bool = True,
                  backend: str | None = None):
    """(backend, max_context) for weights already on `device`; backend: 'torch', 'megakernel' or 'stream'."""
    import torch

    from warploop.llm.backend_torch import TorchBackend

    dtype = str(weights.embed.dtype).removeprefix("torch.")
    backend = check_backend(backend, device, dtype, cfg)
    if block_size < 1:
        raise ValueError(f"block_size must be positive, got {block_size}")
    max_len = min(max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
    probe = KVCacheLayout(cfg.num_layers, 1, block_size, cfg.num_kv_heads, cfg.head_dim, dtype)
    packed = None
    if backend == "stream" and not unsupported_stream(cfg, dtype):
        # the weight pools first, the matrices becoming views of them (one copy of the model, which
        # the per-op path reads too), then the KV cache from what is left
        packed = pack_pools(weights, device, share=True)
        if packed.copied_bytes:                 # the loader put the weights elsewhere: a bug, not the user's
            raise RuntimeError(f"{packed.copied_bytes} bytes of weights were copied into the stream's pools, "
                               f"not shared: the weights must be bfloat16 on {device}")
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()             # the originals' blocks, back to the device
    blocks = num_kv_blocks or kv_blocks_for(probe, device, max_num_seqs, max_len)
    layout = KVCacheLayout(cfg.num_layers, blocks, block_size, cfg.num_kv_heads, cfg.head_dim, dtype)
    max_context = min(max_len, blocks * block_size)
    if backend == "megakernel":
        from warploop.llm.mk.backend import MegakernelBackend
        from warploop.llm.mk.plans import env_options
        return MegakernelBackend(cfg, weights, layout, device, max_context, use_cuda_graphs=use_cuda_graphs,
                                 **env_options()), max_context
    if backend == "stream":
        from warploop import config
        from warploop.llm.stream_backend import StreamBackend
        rows = min(config.get().stream_rows, max_num_seqs)
        return StreamBackend(cfg, weights, layout, device, max_context, use_cuda_graphs=use_cuda_graphs,
                             pools=packed, rows=rows if rows > 1 else 0,
                             prebuilt=config.get().stream_prebuilt), max_context
    return TorchBackend(cfg, weights, layout, device, max_context, use_cuda_graphs=use_cuda_graphs), max_context
