"""The decode megakernel on a GPU against the per-op backend (skips without one).

Run on the device machine: scripts/device_mk.sh. A float32 model must give the per-op backend's
greedy tokens exactly; a bf16 one its logits within bf16 noise, at every batch bucket.
"""
import os

import pytest

os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")   # lazy loading synchronises beside a resident kernel

import torch  # noqa: E402
from mk_helpers import LLAMA_GQA, QWEN3_LIKE, backends, model_weights, run_steps  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
BATCHES = (1, 2, 4, 8, 16, 32)


def prompts(n: int) -> list[list[int]]:
    """n prompts of different lengths (1 to ~150 tokens: one or all attention splits in use)."""
    return [[(7 * i + j) % 190 + 1 for j in range(1 + (37 * i) % 150)] for i in range(n)]


@pytest.mark.parametrize("cfg", [LLAMA_GQA, QWEN3_LIKE], ids=["llama_gqa", "qwen3_like"])
def test_fp32_greedy_tokens_equal_per_op_across_batches(cfg):
    ref, mk = backends(cfg, model_weights(cfg, device="cuda"), max_num_seqs=max(BATCHES), blocks=2048,
                       device="cuda")
    try:
        for n in BATCHES:
            for i, (got, want, graph_argmax) in enumerate(run_steps(ref, mk, prompts(n), steps=4, seed=n)):
                assert got.argmax(-1).tolist() == want.argmax(-1).tolist(), f"batch {n} step {i}"
                assert graph_argmax == got.argmax(-1).tolist(), f"batch {n} step {i}: graph argmax"
                assert float((got - want).abs().max() / want.abs().max()) < 1e-3
    finally:
        mk.close()


def test_bf16_logits_close_to_per_op_across_batches():
    cfg = LLAMA_GQA
    ref, mk = backends(cfg, model_weights(cfg, torch.bfloat16, device="cuda"), max_num_seqs=max(BATCHES),
                       blocks=2048, device="cuda")
    try:
        for n in BATCHES:
            for i, (got, want, _) in enumerate(run_steps(ref, mk, prompts(n), steps=4, seed=n)):
                err = float((got - want).abs().max() / want.abs().max())
                assert err < 3e-2, f"batch {n} step {i}: relative error {err:.2e}"
    finally:
        mk.close()


def test_decode_loop_gives_the_tokens_of_single_steps_fp32():
    """One loop request of 24 steps on the GPU against 24 single graph steps: the same tokens, and
    blocks taken at every boundary (rows of different lengths cross them at different steps)."""
    from mk_loop_helpers import BS, loop, single_steps

    from warploop.llm.mk.loop import LOOP_STEPS
    ref, mk = backends(LLAMA_GQA, model_weights(LLAMA_GQA, device="cuda"), max_num_seqs=4, block_size=BS,
                       blocks=512, device="cuda")
    try:
        rows_in = prompts(4)
        want, _ = single_steps(mk, rows_in, list(range(512)), steps=24)
        tokens, blocks, status, rows, _ = loop(mk, rows_in, list(range(512)), steps=24)
        assert status == LOOP_STEPS and tokens.shape == (24, 4)
        for i in range(4):
            assert rows.tokens[i] + tokens[:, i].tolist() == want[i], f"row {i}"
        assert (blocks >= 0).sum() >= 4 * (24 // BS)
    finally:
        mk.close()


def test_engine_streams_64_concurrent_requests_through_the_decode_loop(monkeypatch):
    """64 requests at once on the tiny model (max_num_seqs 32: arrivals end loops, rows retire at
    different lengths): none lost, and the tokens the engine gives without the loop, with every
    batch on the graph and with the default (batches of 2 or more per op, batch 1 on the graph)."""
    import threading

    from warploop import config
    from warploop.llm.engine import Engine, SamplingParams

    outs = {}
    for loop_on, plan in ((True, '{"graph_rows": 0}'), (False, '{"graph_rows": 0}'), ("default", "{}")):
        monkeypatch.setenv("WARPLOOP_MK_PLAN", plan)
        config.reload()
        with Engine.from_model("tiny", device="cuda", backend="megakernel", progress=False,
                               decode_loop=bool(loop_on)) as engine:
            prompts_ = [engine.tokenizer.encode(f"def f{i}(x):\n    return") for i in range(64)]
            got, done = {}, threading.Semaphore(0)

            def on_event(i, got=got, done=done):
                def cb(event):
                    if event.token_id is not None:
                        got.setdefault(i, []).append(event.token_id)
                    if event.finish_reason is not None:
                        done.release()
                return cb

            for i, p in enumerate(prompts_):
                engine.add_request(p, SamplingParams(max_tokens=8 + (i * 7) % 40, temperature=0.0, ignore_eos=True),
                                   on_event(i))
            for _ in prompts_:
                assert done.acquire(timeout=300), "a request never finished"
            outs[loop_on] = got
            if loop_on != "default":    # the default's last rows are two, so they never loop on the graph
                assert (engine.stats()["decode_loops"] > 0) == loop_on
    monkeypatch.delenv("WARPLOOP_MK_PLAN")
    config.reload()
    assert outs[True] == outs[False]
    # the default computes batches per op (bf16: near ties may go the other way), so only none lost
    for out in (outs[True], outs["default"]):
        assert all(len(out[i]) == 8 + (i * 7) % 40 for i in range(64))
