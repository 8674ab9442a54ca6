"""Chunked prefill: a prompt longer than max_prefill_tokens is prefilled in chunks that take turns
with decode steps of the running requests. The tokens are the unchunked engine's (greedy, seeded,
with and without the prefix cache), running streams keep producing tokens while the prompt is
admitted, and the scheduler's turns are chunk, decode, chunk, ..., the last chunk a normal prefill."""
import threading

import pytest

from warploop.llm.engine import Engine, SamplingParams
from warploop.llm.kv_cache import BlockManager
from warploop.llm.scheduler import Scheduler
from warploop.llm.sequence import Sequence

LONG = "import os\nimport sys\nimport json\n" * 8 + "def main("     # about 90 tokens


def test_scheduler_turns_chunk_decode_chunk_then_the_last_chunk_samples():
    sched = Scheduler(BlockManager(64, 4, enable_prefix_caching=False), max_num_seqs=4, max_batch_tokens=64,
                      max_prefill_tokens=16)
    short = Sequence(list(range(5)), None)
    sched.add(short)
    assert sched.schedule() == ([short], True)
    short.num_computed_tokens = len(short)            # what the engine's accept does
    short.token_ids.append(1)
    long = Sequence(list(range(40)), None)
    sched.add(long)
    turns = []
    for _ in range(6):
        seqs, prefill = sched.schedule()
        turns.append(("chunk" if seqs == [long] and long.chunk_end is not None else
                      "last" if seqs == [long] else "decode", prefill))
        if long.chunk_end is not None:
            assert long.chunk_end - long.num_computed_tokens == 16
            sched.chunk_done(long)
        elif seqs == [long]:
            long.num_computed_tokens = len(long)
            long.token_ids.append(2)
        for s in seqs if not prefill else ():
            s.num_computed_tokens = len(s)
            s.token_ids.append(3)
    assert turns == [("chunk", True), ("decode", False), ("chunk", True), ("decode", False), ("last", True),
                     ("decode", False)]
    assert sched.num_chunks == 3 and sched.prefilling is None and list(sched.running) == [short, long]


def _tokens(prompts, params, **options):
    with Engine.from_model("tiny", device="cpu", progress=False, num_kv_blocks=64, **options) as engine:
        return [engine.generate(p, params).token_ids for p in prompts], engine.stats()


@pytest.mark.parametrize("caching", [True, False])
def test_chunked_prefill_gives_the_tokens_of_whole_prefill(caching):
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    seeded = SamplingParams(max_tokens=8, temperature=0.9, seed=11, ignore_eos=True)
    for params in (greedy, seeded):
        want, whole = _tokens([LONG, LONG[:-3]], params, enable_prefix_caching=caching)
        got, chunked = _tokens([LONG, LONG[:-3]], params, enable_prefix_caching=caching, max_prefill_tokens=16)
        assert got == want
        assert whole["prefill_chunks"] == 0 and chunked["prefill_chunks"] >= 4
        assert chunked["kv_blocks_used"] == 0


def test_a_running_stream_keeps_making_tokens_while_a_long_prompt_is_chunked():
    events, lock, done = [], threading.Lock(), threading.Semaphore(0)

    def on(name):
        def cb(event):
            assert event.error is None, event.error
            with lock:
                events.append((name, event.token_id is not None))
            if event.finish_reason is not None:
                done.release()
        return cb

    with Engine.from_model("tiny", device="cpu", progress=False, num_kv_blocks=64, max_prefill_tokens=8) as engine:
        first = threading.Event()
        stream = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)

        a_inner = on("a")

        def a_cb(event):
            a_inner(event)
            first.set()
        engine.add_request(engine.tokenizer.encode("def f("), stream, a_cb)
        assert first.wait(60)
        with lock:
            events.append(("b arrives", False))
        engine.add_request(engine.tokenizer.encode(LONG), SamplingParams(max_tokens=2, temperature=0.0), on("b"))
        assert done.acquire(timeout=120) and done.acquire(timeout=120)
        chunks = engine.stats()["prefill_chunks"]
    arrived = events.index(("b arrives", False))
    b_first = next(i for i, (name, _) in enumerate(events) if name == "b")
    after_b_arrived = [name for name, _ in events[arrived:b_first]].count("a")
    assert chunks >= 8
    # while b's prompt ran chunk by chunk, a made a token between each two of b's chunks
    assert after_b_arrived >= chunks - 1


def test_max_prefill_tokens_is_checked_by_name():
    with pytest.raises(ValueError, match="--max-prefill-tokens"):
        Engine.from_model("tiny", device="cpu", progress=False, max_prefill_tokens=0)


def test_ttft_splits_into_queueing_and_prefill_and_the_first_step():
    """A Completion's TTFT parts: a request waiting behind another (one sequence at a time) shows
    its wait as queue_ms; queue + prefill is the TTFT; first_step_ms is the first token to the second."""
    with Engine.from_model("tiny", device="cpu", progress=False, num_kv_blocks=64, max_num_seqs=1) as engine:
        done = threading.Event()
        first = engine.add_request(engine.tokenizer.encode(LONG), SamplingParams(max_tokens=40, temperature=0.0,
                                                                                 ignore_eos=True),
                                   lambda e: done.set() if e.finish_reason else None)
        second = engine.generate("def main(", SamplingParams(max_tokens=3, temperature=0.0))
        assert done.wait(60) and first
        alone = engine.generate("def main(", SamplingParams(max_tokens=3, temperature=0.0))
    for c in (second, alone):
        assert abs(c.queue_ms + c.prefill_ms - c.ttft_ms) < 0.05 * c.ttft_ms + 1.0 and c.first_step_ms > 0
    assert second.queue_ms > 5 * alone.queue_ms and second.queue_ms > 10.0   # it waited for the first's 40 tokens
