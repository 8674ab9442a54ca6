"""The streaming kernels the package ships prebuilt, and where a decoder's kernel comes from.

SHIPPED_KERNELS lists the shapes (scripts/stream_prebuild.py --shipped writes them into
runtime/stream/shipped); prebuilt_folder reads WARPLOOP_STREAM_PREBUILT's setting against them, and
first_executor falls back to compiling where a shipped kernel does not load ("auto" never fails a
start the compiler can serve). docs/stream.md, "Compiling".
"""
from __future__ import annotations

import logging

from warploop.runtime.stream.compiled import StreamConfig

log = logging.getLogger("warploop.stream")

# The kernels the package ships prebuilt (runtime/stream/shipped, scripts/stream_prebuild.py
# --shipped): batch 1, sm_90, one a (widest input, head size, group) and the models it serves
SHIPPED_KERNELS = {
    (1024, 64, 2): "the embedded tiny model",
    (2048, 64, 4): "SmolLM2-135M",
    (4096, 64, 4): "SmolLM2-360M",
    (8192, 64, 1): "SmolLM2-1.7B",
    (8192, 64, 4): "Llama-3.2-1B",
    (4096, 128, 2): "Qwen3-0.6B",
    (8192, 128, 2): "Qwen3-1.7B",
    (8192, 128, 4): "Llama-3.2-3B",
    (16384, 128, 4): "Llama-3.1-8B, Qwen3-4B, Qwen3-8B",
}
SHIPPED_ARCH = 90


def shipped_configs() -> list[StreamConfig]:
    return [StreamConfig(kmax=k, head_dim=hd, attn_group=g) for k, hd, g in SHIPPED_KERNELS]


def prebuilt_folder(setting: str | None, config: StreamConfig, arch: int,
                    block_size: int = 16) -> tuple[str | None, str]:
    """Where a decoder's kernel launches from for WARPLOOP_STREAM_PREBUILT's `setting` (None or
    "off": compiled; "auto": the shipped kernels when they hold `config` for sm_`arch` and a KV
    cache of `block_size`-token blocks; else that folder), and why it compiles when it does ("" when
    it does not, or when asked to)."""
    from warploop.runtime.stream import prebuilt
    if setting in (None, "off"):
        return None, ""
    if setting != "auto":
        return setting, ""
    kv_box = config.kv_box(block_size) if config.head_dim else None
    entry, why = prebuilt.find(prebuilt.SHIPPED, config.constexprs(), arch, kv_box)
    return (str(prebuilt.SHIPPED), "") if entry is not None else (None, why)




def first_executor(make, prebuilt: str | None, auto: bool):
    """make(prebuilt) -> the decoder's first executor, and the folder it launches from, and why it
    compiles ("" if not). With auto (WARPLOOP_STREAM_PREBUILT=auto), a shipped kernel that does not
    load (a driver too old for its cubin, say) is compiled instead, saying why: auto never fails a
    start the compiler can serve."""
    try:
        return make(prebuilt), prebuilt, ""
    except (ValueError, RuntimeError) as e:
        if not (auto and prebuilt is not None):
            raise
        why = f"the shipped kernel did not load ({type(e).__name__}: {e})"
        log.warning("warploop: %s; compiling the streaming kernel", why)
        return make(None), None, why
