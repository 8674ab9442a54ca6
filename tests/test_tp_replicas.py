"""Replicas (warploop/llm/replicas.py) on the CPU: two tiny engines in two processes. The pool sends
each request to the replica with the fewest in flight; a replica that dies fails its own requests
with an error naming it while the other keeps serving; `warploop serve --replicas 2` answers
concurrent requests through one endpoint."""
from __future__ import annotations

import asyncio
import os
import queue
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from warploop.llm.params import SamplingParams

httpx = pytest.importorskip("httpx")

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 120


def collector():
    events: queue.Queue = queue.Queue()
    return events, events.put


def last_event(events: queue.Queue):
    deadline = time.monotonic() + TIMEOUT_S
    while True:
        event = events.get(timeout=max(0.1, deadline - time.monotonic()))
        if event.finish_reason is not None:
            return event


@pytest.fixture(scope="module")
def pool():
    from warploop.llm.replicas import ReplicaPool

    with ReplicaPool("tiny", 2, device="cpu", num_kv_blocks=96, max_num_seqs=8, dtype="float32") as p:
        yield p


def test_pool_refuses_bad_requests_at_once(pool):
    with pytest.raises(ValueError, match="prompt is empty"):
        pool.add_request([], SamplingParams(), lambda e: None)
    with pytest.raises(ValueError, match="exceeds the context"):
        pool.add_request([5] * 10, SamplingParams(max_tokens=pool.max_context), lambda e: None)


def test_least_outstanding_then_a_dead_replica_fails_only_its_requests(pool):
    long = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
    short = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    queues = []
    for i in range(4):   # alternates: 0 and 2 land on replica 0 (long), 1 and 3 on replica 1 (short)
        events, put = collector()
        pool.add_request([10 + i, 11, 12], long if i % 2 == 0 else short, put)
        queues.append(events)
        assert sorted(len(r.outstanding) for r in pool.replicas) == [(i + 1) // 2, (i + 2) // 2]
    assert [len(r.outstanding) for r in pool.replicas] == [2, 2]
    assert all(last_event(queues[i]).finish_reason == "length" for i in (1, 3))
    victim = pool.replicas[0]
    assert len(victim.outstanding) == 2   # still generating its 400 tokens
    os.kill(victim.proc.pid, signal.SIGKILL)
    for i in (0, 2):
        end = last_event(queues[i])
        assert end.finish_reason == "abort" and re.search(r"replica 0 \(pid \d+\) exited", end.error)
    events, put = collector()
    pool.add_request([1, 2, 3], short, put)   # the survivor takes it
    done = last_event(events)
    assert done.finish_reason == "length" and done.completion_tokens == 8
    assert pool.stats()["replicas_alive"] == 1


def test_serve_two_replicas_answers_concurrent_requests(tmp_path):
    log = tmp_path / "serve.log"
    env = dict(os.environ, WARPLOOP_DEVICE="cpu", PYTHONUNBUFFERED="1")
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "warploop.cli", "serve", "--model", "tiny", "--port", "0",
                                 "--replicas", "2", "--num-kv-blocks", "64", "--log-level", "warning"],
                                stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not (match := re.search(r"serving .* on (http://\S+) ", log.read_text())):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        url = match.group(1)

        async def ask(client, i):
            body = {"model": "tiny", "prompt": f"def f{i}(", "max_tokens": 6, "temperature": 0}
            return await client.post(f"{url}/v1/completions", json=body)

        async def burst():
            async with httpx.AsyncClient(timeout=TIMEOUT_S) as client:
                return await asyncio.gather(*(ask(client, i) for i in range(8)))

        replies = asyncio.run(burst())
        assert [r.status_code for r in replies] == [200] * 8
        assert all(r.json()["choices"][0]["finish_reason"] in ("length", "stop") for r in replies)
        assert httpx.get(f"{url}/metrics", timeout=10).status_code == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            assert proc.wait(timeout=60) == 0, log.read_text()
        finally:
            proc.kill()
