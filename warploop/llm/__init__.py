"""The LLM engine: Hugging Face-format models, paged KV cache, prefix caching, continuous batching.

Nothing here is imported by `import warploop`; torch is loaded only when an engine is built.
Start from `warploop.llm.engine.Engine` (interface in docs/engine-api.md).
"""
