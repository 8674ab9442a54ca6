"""The decode megakernel: one engine decode step as one static graph of tile tasks on the resident
runtime (warploop/runtime). docs/megakernel.md describes the graph.

    layout.py     the step's input block (a buffer at a fixed address) and the plan's sizes, as data
    numerics.py   rounding and dots made the same in the Triton interpreter as on the GPU
    tokens.py     embedding gather (token ids in)
    gemv.py       GEMV pieces: fused RMSNorm prologue, batch rows, residual / SiLU epilogues; run-time widths
    gemv_tile.py  the GPU plan's GEMVs over compile-time widths: fixed tiles of rows, all chunks in flight
    attention.py  RoPE + paged KV write, split paged decode attention with GQA, the split combine
    sample.py     sampling per row (greedy, temperature, top-k/p, min-p, penalty, seeds): token ids out
    tasks.py      the task registrations, one set per plan (dtype and model shapes as constexprs)
    graph.py      the per-step graph for a config and a batch bucket
    plans.py      which resident kernels a backend compiles (batch 1's, the batches'), WARPLOOP_MK_PLAN
    backend.py    MegakernelBackend: decode on the graph, prefill on the per-op path
"""
