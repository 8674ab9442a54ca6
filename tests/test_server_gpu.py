"""`warploop serve --backend megakernel` on a GPU (skips without one): 64 concurrent streams through
the OpenAI-compatible server, each decode batch run as a loop inside the resident kernel; none is
lost, each stream's text equals the same request's non-streamed answer, and the server ends idle.
Raw HTTP (httpx): the GPU machine has no `openai` package. Run by scripts/device_mk.sh (part server).
"""
from __future__ import annotations

import asyncio
import json
import time

import pytest
from server_helpers import ABORTED, Server

torch = pytest.importorskip("torch")
httpx = pytest.importorskip("httpx")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")

STREAMS = 64
START_S = 900          # the first start of a model shape compiles the resident kernel (minutes)


def prompts(n: int) -> list[str]:
    words = ["import", "def", "class", "return", "self", "for", "while", "with"]
    return [f"{words[i % 8]} {words[(i // 8) % 8]}_{i}(" for i in range(n)]


async def completion(client: httpx.AsyncClient, prompt: str, max_tokens: int, stream: bool) -> tuple[str, str]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    if not stream:
        r = await client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        return choice["text"], choice["finish_reason"]
    text, reason = [], None
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            text.append(choice["text"])
            reason = choice.get("finish_reason") or reason
    return "".join(text), reason


def idle_metrics(srv, within_s: float = 30.0) -> dict:
    """The server's metrics once no request runs and every KV block is free (at most within_s)."""
    deadline = time.monotonic() + within_s
    while True:
        m = srv.metrics()
        if m["warploop_num_requests_running"] == 0 and m["warploop_kv_blocks_used"] == 0:
            return m
        assert time.monotonic() < deadline, f"not idle: {m}"
        time.sleep(0.1)


def test_64_concurrent_streams_on_the_megakernel(tmp_path):
    # float32: a row batched with others and the same row alone sum in another order; in bf16 a near
    # tie could flip a greedy token, in float32 it does not
    srv = Server(["--device", "cuda", "--backend", "megakernel", "--dtype", "float32", "--max-num-seqs", "32"],
                 tmp_path / "serve.log",
                 start_timeout_s=START_S, env={"CUDA_MODULE_LOADING": "EAGER"})
    try:
        texts = prompts(STREAMS)
        lengths = [8 + (i * 7) % 40 for i in range(STREAMS)]     # rows retire at different steps

        async def run():
            async with httpx.AsyncClient(base_url=srv.url, timeout=300) as client:
                alone = [await completion(client, p, n, False) for p, n in zip(texts, lengths, strict=True)]
                streams = await asyncio.gather(*(completion(client, p, n, True)
                                                 for p, n in zip(texts, lengths, strict=True)))
            return alone, streams

        m0 = srv.metrics()
        alone, streams = asyncio.run(run())
        assert all(reason in ("length", "stop") for _, reason in streams), "a stream ended without a finish reason"
        assert [t for t, _ in streams] == [t for t, _ in alone]
        assert len({t for t, _ in alone}) > 1
        m = idle_metrics(srv)
        ok = "warploop_http_requests_total{route=/v1/completions,status=200}"
        assert m[ok] - m0.get(ok, 0) == 2 * STREAMS and m.get(ABORTED, 0) == m0.get(ABORTED, 0)
    finally:
        assert srv.stop() == 0, srv.log.read_text()[-3000:]


def test_64_concurrent_streams_on_the_stream_backend(tmp_path):
    """`--backend stream` (bfloat16): batch 1 on the streaming executor's decode loop, larger batches
    per op; 64 concurrent streams all finish, each with a finish reason, and the server ends idle
    with every KV block free. (Texts are not compared with solo requests: a row batched per op in
    bf16 and the same row alone on the streaming kernel sum in other orders.)"""
    srv = Server(["--device", "cuda", "--backend", "stream", "--dtype", "bfloat16", "--max-num-seqs", "32"],
                 tmp_path / "serve.log", start_timeout_s=START_S, env={"CUDA_MODULE_LOADING": "EAGER"})
    try:
        texts = prompts(STREAMS)
        lengths = [8 + (i * 7) % 40 for i in range(STREAMS)]

        async def run():
            async with httpx.AsyncClient(base_url=srv.url, timeout=300) as client:
                solo = await completion(client, texts[0], 40, False)
                streams = await asyncio.gather(*(completion(client, p, n, True)
                                                 for p, n in zip(texts, lengths, strict=True)))
            return solo, streams

        m0 = srv.metrics()
        solo, streams = asyncio.run(run())
        assert solo[1] in ("length", "stop") and solo[0]
        assert all(reason in ("length", "stop") for _, reason in streams), "a stream ended without a finish reason"
        m = idle_metrics(srv)
        ok = "warploop_http_requests_total{route=/v1/completions,status=200}"
        assert m[ok] - m0.get(ok, 0) == STREAMS + 1 and m.get(ABORTED, 0) == m0.get(ABORTED, 0)
    finally:
        assert srv.stop() == 0, srv.log.read_text()[-3000:]
