"""The model shapes `warploop bench decode` measures: they live in warploop.llm.shapes (tests and
the megakernel's tools use them too); this name stays for the bench's and the stream scripts' imports."""
from warploop.llm.shapes import (  # noqa: F401
    CPU_MODELS,
    GPU_MODELS,
    LLAMA_3_2_1B,
    QWEN3_0_6B,
    SMALL_CPU,
    SMOLLM2_135M,
)
