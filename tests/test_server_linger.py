"""A body too large for the server is answered 413, and every client reads that answer.

The hole this closes: a 30 MB body sent by `httpx.AsyncClient` while other requests ran ended in
`httpx.ReadError`. The server answered 413 and closed while the client was still sending; the
unread bytes made the kernel reset the connection, which discards the 413 before the client reads
it. The server now closes lingering (it half-closes, then reads and discards up to a bound).
"""
from __future__ import annotations

import asyncio
import time

import pytest
from server_helpers import ROOT, Server

httpx = pytest.importorskip("httpx")

pytestmark = pytest.mark.skipif(not (ROOT / "warploop/llm/tiny/config.json").exists(), reason="needs the tiny model")

BIG = 30 << 20  # 30 MB, past the default --max-body-bytes (4 MiB)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = Server([], tmp_path_factory.mktemp("linger") / "serve.log")
    yield srv
    assert srv.stop() == 0, srv.log.read_text()


async def big_and_busy(url: str, chunked: bool) -> tuple[list[httpx.Response], httpx.Response]:
    """Four streams and chats beside one oversized POST, all from one AsyncClient."""
    body = b'{"prompt": "' + b"x" * BIG + b'"}'  # built here: a failure's report must not print 30 MB
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        async def chunks():
            for i in range(0, len(body), 1 << 20):
                yield body[i:i + (1 << 20)]

        async def stream(i: int) -> httpx.Response:
            payload = {"prompt": f"def f_{i}(", "max_tokens": 8, "stream": True}
            async with client.stream("POST", "/v1/completions", json=payload) as r:
                await r.aread()
                return r

        async def chat(i: int) -> httpx.Response:
            return await client.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": f"import m{i}"}], "max_tokens": 8})

        others = [asyncio.ensure_future(f(i)) for i in range(2) for f in (stream, chat)]
        big = await client.post("/v1/completions", content=chunks() if chunked else body,
                                headers={"content-type": "application/json"})
        return list(await asyncio.gather(*others)), big


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_30mb_body_from_async_client_reads_413(server, chunked):
    for _ in range(3):  # the reset was a race: try it more than once
        start = time.perf_counter()
        others, big = asyncio.run(big_and_busy(server.url, chunked))
        assert big.status_code == 413, big.text
        assert big.json()["error"]["code"] == "body_too_large"
        assert "--max-body-bytes" in big.json()["error"]["message"]
        assert [r.status_code for r in others] == [200] * 4
        assert time.perf_counter() - start < 30
    assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
