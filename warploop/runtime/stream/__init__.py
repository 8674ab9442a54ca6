"""The streaming executor: static graphs of tile nodes in one persistent Gluon kernel on Hopper,
where a loader warp streams every node's weights and cached context into a shared-memory ring ahead of the
dependencies and a consumer warpgroup waits only on activations (docs/stream.md).

    kinds.py      node kinds and instruction words, declared once as data
    program.py    a program: weight pools, arenas, nodes, placement, instruction words
    hazards.py    the hazard check: every write ordered against every other touch
    kernel.py     the Gluon kernel (the consumer and publisher roles, the batch-1 GEMV body)
    loader.py     the loader role: every node's streamed operand into the ring by TMA
    gemv_rows.py  a batched kernel's GEMV body, on tensor cores
    small.py      the bodies of the kinds with no streamed operand (EMBED, SAMPLE, NOP)
    attention.py  the attention kind's body (the loader's context stream, the consumer's fp32 softmax)
    shares.py     a KV head's context in shares, and their merge
    kv_rows.py    the rows a share reads: this launch's, patched over the ring's copies; q/k's RoPE
    sync.py       waits with a way out, the clock, Triton-version aliases
    compiled.py   its compile-time shape (StreamConfig), compiling without a GPU, resources
    builds.py     a placed program, and the folder that keeps placed programs for the next start
    executor.py   running a program on the GPU, with bounded waits and a timeout
    reference.py  the CPU executor every GPU run is diffed against
"""
