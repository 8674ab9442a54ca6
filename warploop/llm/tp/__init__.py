"""Tensor parallelism for the per-op backend: one process per rank, Megatron-style sharding.

shard.py: which slice of every checkpoint tensor each rank holds (pure arithmetic).
load.py: a rank's weights read slice by slice from the safetensors files.
group.py: the worker processes and the torch.distributed group.
backend.py: the sharded forward (all-reduces, vocab-parallel embedding and lm_head) and the
step protocol between rank 0 (which runs the engine and samples) and the other ranks.
build.py: an Engine over N ranks. docs/parallel.md describes the whole.
"""
