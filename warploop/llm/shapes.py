"""Model shapes (random weights of these exact configurations): what `warploop bench decode` measures,
and what the tests and the megakernel's tools build graphs for."""
from __future__ import annotations

from warploop.llm.config import ModelConfig
from warploop.llm.rope import RopeConfig

LLAMA_3_2_1B = ModelConfig(
    family="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32,
    num_kv_heads=8, head_dim=64, rms_norm_eps=1e-5, max_position_embeddings=131072, tie_word_embeddings=True,
    rope=RopeConfig(rope_type="llama3", theta=500000.0, factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=8192),
    dtype="bfloat16", eos_token_ids=(128001,), bos_token_id=128000)
QWEN3_0_6B = ModelConfig(
    family="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_layers=28, num_heads=16,
    num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6, max_position_embeddings=40960, tie_word_embeddings=True,
    qk_norm=True, rope=RopeConfig(rope_type="default", theta=1000000.0), dtype="bfloat16", eos_token_ids=(151645,))
SMOLLM2_135M = ModelConfig(
    family="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
    num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, max_position_embeddings=8192, tie_word_embeddings=True,
    rope=RopeConfig(rope_type="default", theta=100000.0), dtype="bfloat16", eos_token_ids=(0,))
SMALL_CPU = ModelConfig(
    family="llama", vocab_size=8192, hidden_size=256, intermediate_size=1024, num_layers=4, num_heads=8,
    num_kv_heads=2, head_dim=32, rms_norm_eps=1e-5, max_position_embeddings=4096, tie_word_embeddings=True,
    rope=LLAMA_3_2_1B.rope, dtype="float32")
GPU_MODELS = {"llama-3.2-1b": ("Llama-3.2-1B (exact shapes)", LLAMA_3_2_1B),
              "qwen3-0.6b": ("Qwen3-0.6B (exact shapes)", QWEN3_0_6B),
              "smollm2-135m": ("SmolLM2-135M (exact shapes)", SMOLLM2_135M)}
CPU_MODELS = {"small-cpu": ("small Llama (no GPU: CPU run, not Llama-3.2-1B)", SMALL_CPU)}
