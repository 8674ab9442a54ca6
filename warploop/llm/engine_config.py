"""The engine's settings: one typed record, checked in one place.

`Engine.from_model(model, **options)` builds one from its keywords, `warploop generate` and
`warploop serve` from their flags; every check runs before anything loads and names the option's
flag, so a bad value fails at once with the fix in the message.

    from warploop.llm.engine_config import EngineConfig
    config = EngineConfig(device="cuda", dtype="bfloat16", max_num_seqs=64)
    engine = Engine.from_model("path/to/model", config=config)
"""
from __future__ import annotations

import dataclasses

from warploop.llm.build import check_backend

DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    device: str | None = None            # cpu, cuda (cuda:N), hip; None: probe (WARPLOOP_DEVICE)
    dtype: str | None = None             # float32, bfloat16, float16; None: the checkpoint's
    backend: str | None = None           # torch, megakernel, stream; None: the device's default (build.py)
    block_size: int = 16                 # tokens per KV block
    num_kv_blocks: int | None = None     # None: sized from free memory
    max_model_len: int | None = None     # prompt + output tokens; None: the model's
    max_num_seqs: int = 32               # requests in one batch
    max_batch_tokens: int = 2048         # tokens in one step, prefill included
    max_prefill_tokens: int = 2048       # a longer prompt is prefilled in chunks of this many
    enable_prefix_caching: bool = True
    decode_loop: bool = True             # decode batches as loops on the device, where the backend can
    use_cuda_graphs: bool = True
    tensor_parallel: int = 1             # ranks the model is split over
    progress: bool = True                # a progress bar while weights load

    FLAGS = {"device": "--device", "dtype": "--dtype", "backend": "--backend", "block_size": "--block-size",
             "num_kv_blocks": "--num-kv-blocks", "max_model_len": "--max-model-len", "max_num_seqs": "--max-num-seqs",
             "max_batch_tokens": "--max-batch-tokens", "max_prefill_tokens": "--max-prefill-tokens",
             "enable_prefix_caching": "--no-prefix-caching", "decode_loop": "decode_loop",
             "use_cuda_graphs": "use_cuda_graphs", "tensor_parallel": "--tensor-parallel", "progress": "progress"}

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_seqs", "max_batch_tokens", "max_prefill_tokens", "tensor_parallel"):
            self._positive(name, getattr(self, name))
        for name in ("num_kv_blocks", "max_model_len"):
            if getattr(self, name) is not None:
                self._positive(name, getattr(self, name))
        for name in ("enable_prefix_caching", "decode_loop", "use_cuda_graphs", "progress"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} ({self.FLAGS[name]}): use True or False")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not supported ({self.FLAGS['dtype']}): use one of "
                             f"{', '.join(DTYPES)}, or leave it out for the checkpoint's")
        if self.device is not None and not isinstance(self.device, str):
            raise ValueError(f"device={self.device!r} ({self.FLAGS['device']}): use cpu, cuda, cuda:N or hip")
        if self.backend is not None:
            check_backend(self.backend)
            if self.tensor_parallel != 1 and self.backend not in ("torch", "stream"):
                raise ValueError(f"--backend {self.backend} does not run under --tensor-parallel yet: use "
                                 "--backend torch or stream")

    def _positive(self, name: str, value) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} ({self.FLAGS[name]}): use a positive whole number")

    @classmethod
    def from_options(cls, options: dict) -> EngineConfig:
        """A config from keyword options; an unknown one is refused with the known ones listed."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"unknown engine option{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; "
                             f"the options are {', '.join(sorted(known))}")
        return cls(**options)

    def options(self) -> dict:
        return dataclasses.asdict(self)
