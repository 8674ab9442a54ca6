"""`warploop serve --model tiny` end to end: a real server subprocess on a free loopback port, driven
by the official `openai` client and raw HTTP. One server serves the whole module (with an API key and
a small KV pool, so that 32 concurrent requests must queue for blocks); a second one is started to
check graceful shutdown.
"""
from __future__ import annotations

import asyncio
import json
import signal
import socket
import time

import pytest
from server_helpers import ABORTED, KEY, ROOT, Server

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

NEEDED = ["warploop/llm/engine.py", "warploop/llm/tiny/config.json"]
MISSING = [p for p in NEEDED if not (ROOT / p).exists()]
pytestmark = pytest.mark.skipif(bool(MISSING), reason=f"warploop serve --model tiny needs {', '.join(MISSING)}")

BLOCK_SIZE = 16
KV_BLOCKS = 16     # 256 tokens: 32 concurrent requests of at least one block each must queue for blocks
MAX_TOKENS = 6     # small: the suite must stay fast on 2 shared cores


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = Server(["--api-key", KEY, "--block-size", str(BLOCK_SIZE), "--num-kv-blocks", str(KV_BLOCKS)],
                 tmp_path_factory.mktemp("serve") / "serve.log")
    yield srv
    assert srv.stop() == 0, srv.log.read_text()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=60)


def wait_until_idle(server: Server, timeout_s: float = 20) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    while True:
        m = server.metrics()
        if m["warploop_num_requests_running"] == 0 and m["warploop_num_requests_waiting"] == 0 \
                and m["warploop_kv_blocks_used"] == 0:
            return m
        assert time.monotonic() < deadline, f"engine not idle after {timeout_s} s: {m}"
        time.sleep(0.1)


def prompts(n: int) -> list[str]:
    words = ["import", "def", "class", "return", "self", "for", "while", "with"]
    return [f"{words[i % 8]} {words[(i // 8) % 8]}_{i}(" for i in range(n)]


# --- the openai client -------------------------------------------------------------------------

def test_models_and_health(server, client):
    assert httpx.get(f"{server.url}/health").json()["status"] == "ok"
    [model] = client.models.list().data
    assert model.id == "tiny"
    assert client.models.retrieve("tiny").id == "tiny"


def test_completion_stream_matches_non_stream(client):
    full = client.completions.create(model="tiny", prompt="def main(", max_tokens=MAX_TOKENS, temperature=0)
    choice = full.choices[0]
    assert choice.finish_reason in ("length", "stop") and choice.text
    assert full.usage.completion_tokens <= MAX_TOKENS and full.usage.prompt_tokens > 0
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens

    chunks = list(client.completions.create(model="tiny", prompt="def main(", max_tokens=MAX_TOKENS,
                                            temperature=0, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage == full.usage


def test_chat_stream_matches_non_stream(client):
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "import os"}]
    full = client.chat.completions.create(model="tiny", messages=messages, max_tokens=MAX_TOKENS, temperature=0)
    message = full.choices[0].message
    assert message.role == "assistant" and message.content
    assert full.object == "chat.completion" and full.usage.completion_tokens <= MAX_TOKENS

    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=MAX_TOKENS,
                                                 temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == message.content
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason
    assert all(c.id == chunks[0].id and c.object == "chat.completion.chunk" for c in chunks)


def test_stop_string_and_seed(client):
    greedy = client.completions.create(model="tiny", prompt="class A:", max_tokens=MAX_TOKENS, temperature=0)
    text = greedy.choices[0].text
    stop = text[len(text) // 2:][:2]
    assert stop.strip(), f"greedy output {text!r} has no usable stop string"
    stopped = client.completions.create(model="tiny", prompt="class A:", max_tokens=MAX_TOKENS, temperature=0,
                                        stop=[stop]).choices[0]
    assert stopped.finish_reason == "stop" and stopped.text == text[:text.index(stop)]

    sampled = [client.completions.create(model="tiny", prompt="for i in", max_tokens=MAX_TOKENS, temperature=1.0,
                                         top_p=0.9, seed=1234).choices[0].text for _ in range(2)]
    assert sampled[0] == sampled[1]


def test_32_concurrent_streams_get_their_own_output(server):
    texts = prompts(32)
    m0 = server.metrics()

    async def run() -> tuple[list[tuple[str, int]], list[str]]:
        aclient = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=120)

        async def one(prompt: str) -> tuple[str, int]:
            r = await aclient.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
            return r.choices[0].text, r.usage.total_tokens

        async def streamed(prompt: str) -> str:
            stream = await aclient.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS,
                                                      temperature=0, stream=True)
            return "".join([chunk.choices[0].text async for chunk in stream])

        reference = [await one(p) for p in texts]
        streams = await asyncio.gather(*(streamed(p) for p in texts))
        await aclient.close()
        return reference, streams

    results, streams = asyncio.run(run())
    reference = [text for text, _ in results]
    assert sum(-(-total // BLOCK_SIZE) for _, total in results) > KV_BLOCKS, "the KV pool should run out"
    assert streams == reference
    assert len(set(reference)) > 1, "distinct prompts should give distinct outputs"
    m1 = wait_until_idle(server)
    aborted, ok = ABORTED, "warploop_http_requests_total{route=/v1/completions,status=200}"
    assert m1.get(aborted, 0) == m0.get(aborted, 0)
    assert m1[ok] - m0.get(ok, 0) == 64


# --- bad requests ------------------------------------------------------------------------------

AUTH = {"Authorization": f"Bearer {KEY}"}
LONG = "<a prompt longer than the context>"


@pytest.mark.parametrize("path,body,status,param,code", [
    ("/v1/completions", b'{"prompt": "x", ', 400, None, "invalid_json"),
    ("/v1/completions", b'[1, 2]', 400, None, None),
    ("/v1/completions", {"model": "gpt-4", "prompt": "x"}, 404, "model", "model_not_found"),
    ("/v1/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "x"}]},
     404, "model", "model_not_found"),
    ("/v1/completions", {"prompt": LONG}, 400, "prompt", "context_length_exceeded"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG}]},
     400, "messages", "context_length_exceeded"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 10**6}, 400, "max_tokens", "context_length_exceeded"),
    ("/v1/completions", {}, 400, "prompt", None),
    ("/v1/completions", {"prompt": ""}, 400, "prompt", None),
    ("/v1/completions", {"prompt": 7}, 400, "prompt", None),
    ("/v1/completions", {"prompt": [10**9]}, 400, None, None),
    ("/v1/completions", {"prompt": ["a", "b"]}, 400, "prompt", None),
    ("/v1/completions", {"prompt": "x", "n": 2}, 400, "n", None),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens", None),
    ("/v1/completions", {"prompt": "x", "temperature": 3}, 400, "temperature", None),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature", None),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p", None),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, 400, "stop", None),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options", None),
    ("/v1/completions", {"prompt": "x", "logprobs": 2}, 400, "logprobs", None),
    ("/v1/completions", {"prompt": "x", "frequency_penalty": 0.5}, 400, "frequency_penalty", None),
    ("/v1/completions", {"prompt": "x", "bogus": 1}, 400, "bogus", None),
    ("/v1/chat/completions", {"messages": []}, 400, "messages", None),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages.0.role", None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 3}, 400, "n", None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
     400, "tools", None),
    # JSON types as documented: no coercion
    ("/v1/completions", {"prompt": "x", "max_tokens": "5"}, 400, "max_tokens", None),
    ("/v1/completions", {"prompt": "x", "max_tokens": True}, 400, "max_tokens", None),
    ("/v1/completions", {"prompt": "x", "max_tokens": 5.0}, 400, "max_tokens", None),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, 400, "stream", None),
    ("/v1/completions", {"prompt": "x", "seed": "7"}, 400, "seed", None),
    ("/v1/completions", {"prompt": "x", "temperature": "0.5"}, 400, "temperature", None),
    ("/v1/completions", {"prompt": [1, True]}, 400, "prompt", None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, "messages.0.content", None),
    # what the engine represents
    ("/v1/completions", {"prompt": "x", "top_k": 2**63}, 400, "top_k", None),
    ("/v1/completions", {"prompt": "x", "seed": 2**64}, 400, "seed", None),
    ("/v1/completions", {"prompt": "x", "repetition_penalty": 1e-300}, 400, "repetition_penalty", None),
    ("/v1/completions", {"prompt": "x", "stop": ["s"] * 20000}, 400, "stop", None),
    ("/v1/completions", {"prompt": "x", "stop": "s" * 300}, 400, "stop", None),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": list(range(300))}, 400, "stop_token_ids", None),
])
def test_bad_request_gets_openai_error(server, path, body, status, param, code):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    if LONG.encode() in content:
        context = httpx.get(f"{server.url}/v1/models", headers=AUTH).json()["data"][0]["max_model_len"]
        # One line per number: at least one token each, whatever the tokenizer merges.
        content = content.replace(LONG.encode(), json.dumps("\n".join(map(str, range(context + 1))))[1:-1].encode())
    r = httpx.post(f"{server.url}{path}", content=content, headers={**AUTH, "Content-Type": "application/json"},
                   timeout=30)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", param, code), error


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}])
def test_missing_or_wrong_api_key_is_401(server, headers):
    for method, path in [("GET", "/v1/models"), ("POST", "/v1/completions")]:
        r = httpx.request(method, f"{server.url}{path}", json={"prompt": "x"}, headers=headers, timeout=10)
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "invalid_api_key"


def test_openai_client_raises_typed_errors(server):
    bad_key = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad_key.models.list()
    good = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.NotFoundError):
        good.completions.create(model="gpt-4", prompt="x")
    with pytest.raises(openai.BadRequestError, match="n=2"):
        good.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], n=2)


def test_api_docs_need_the_key(server):
    for path in ("/docs", "/redoc"):
        assert httpx.get(f"{server.url}{path}", headers=AUTH).status_code == 404
    assert httpx.get(f"{server.url}/openapi.json").status_code == 401
    schema = httpx.get(f"{server.url}/openapi.json", headers=AUTH)
    assert schema.status_code == 200 and "/v1/completions" in schema.json()["paths"]


def test_tiny_temperature_and_top_p_are_not_token_zero_forever(client):
    greedy = client.completions.create(model="tiny", prompt="def f(", max_tokens=MAX_TOKENS, temperature=0)
    for extra in ({"temperature": 1e-38}, {"top_p": 1e-45, "seed": 5}):
        out = client.completions.create(model="tiny", prompt="def f(", max_tokens=MAX_TOKENS, **extra)
        assert out.choices[0].text == greedy.choices[0].text, extra


def test_a_refused_request_does_not_disturb_four_good_ones(server):
    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=60) as http:
            good = {"prompt": "import os", "max_tokens": MAX_TOKENS, "temperature": 0.5, "seed": 1}
            bodies = [good] * 2 + [{**good, "top_k": 2**63}] + [good] * 2
            return await asyncio.gather(*(http.post("/v1/completions", json=b) for b in bodies))

    responses = asyncio.run(run())
    assert [r.status_code for r in responses] == [200, 200, 400, 200, 200]
    assert responses[2].json()["error"]["param"] == "top_k"
    assert len({r.json()["choices"][0]["text"] for i, r in enumerate(responses) if i != 2}) == 1


def test_unknown_route_and_method(server):
    assert httpx.get(f"{server.url}/v2/nothing").status_code == 404
    r = httpx.get(f"{server.url}/v1/completions", headers=AUTH)
    assert r.status_code == 405 and "GET" in r.json()["error"]["message"]


# --- disconnects, metrics, shutdown ------------------------------------------------------------

def _long_request(stream: bool) -> bytes:
    return json.dumps({"prompt": "import sys\n", "max_tokens": 200, "temperature": 0, "ignore_eos": True,
                       "stream": stream}).encode()


def test_disconnect_mid_stream_frees_kv_blocks(server):
    m0 = wait_until_idle(server)
    with httpx.stream("POST", f"{server.url}/v1/completions", content=_long_request(True),
                      headers=AUTH, timeout=30) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(4)]
        assert got[0].startswith("data: ")
        assert server.metrics()["warploop_kv_blocks_used"] > 0
    m1 = wait_until_idle(server)
    assert m1[ABORTED] == m0.get(ABORTED, 0) + 1
    assert m1["warploop_generation_tokens_total"] - m0["warploop_generation_tokens_total"] < 200


def test_disconnect_while_waiting_for_non_streamed_answer_frees_kv_blocks(server):
    m0 = wait_until_idle(server)
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    body = _long_request(False)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Authorization: Bearer {KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        deadline = time.monotonic() + 20
        while server.metrics()["warploop_generation_tokens_total"] == m0["warploop_generation_tokens_total"]:
            assert time.monotonic() < deadline, "the request never started generating"
            time.sleep(0.05)
    m1 = wait_until_idle(server)
    assert m1[ABORTED] == m0.get(ABORTED, 0) + 1
    assert m1["warploop_generation_tokens_total"] - m0["warploop_generation_tokens_total"] < 200


def test_metrics_expose_counters(server, client):
    client.completions.create(model="tiny", prompt="while True:", max_tokens=2, temperature=0)
    m = server.metrics()
    assert m["warploop_http_requests_total{route=/v1/completions,status=200}"] >= 1
    assert m["warploop_http_requests_total{route=/v1/completions,status=400}"] >= 1
    assert m["warploop_requests_finished_total{finish_reason=length}"] >= 1
    assert m["warploop_prompt_tokens_total"] > 0 and m["warploop_generation_tokens_total"] > 0
    assert m["warploop_time_to_first_token_seconds_count"] >= 1
    assert m["warploop_request_latency_seconds_count"] >= 1
    assert m["warploop_kv_blocks_total"] == KV_BLOCKS
    assert m["warploop_num_requests_running"] == 0 and m["warploop_num_requests_waiting"] == 0
    assert "warploop_prefix_cache_hit_tokens_total" in m
    assert m["warploop_deferred_start_pending"] in (0, 1)       # 1 until the engine's deferred start work is done
    assert m["warploop_prefill_steps_total"] >= 1 and m["warploop_decode_steps_total"] >= 1


def _sigterm_mid_stream(srv: Server, signals: int) -> list[str]:
    """A stream's first event, then `signals` SIGTERMs; the rest of the stream's lines."""
    with httpx.stream("POST", f"{srv.url}/v1/completions", timeout=30,
                      json={"prompt": "import os", "max_tokens": 24, "temperature": 0, "ignore_eos": True,
                            "stream": True}) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        for _ in range(signals):
            srv.proc.send_signal(signal.SIGTERM)
        return [line for line in lines if line]


def test_sigterm_finishes_in_flight_stream_then_exits(tmp_path):
    srv = Server([], tmp_path / "serve.log")
    try:
        assert _sigterm_mid_stream(srv, 1)[-1] == "data: [DONE]"
    finally:
        assert srv.stop() == 0, srv.log.read_text()


def test_repeated_sigterm_while_stopping_still_exits_cleanly(tmp_path):
    # A supervisor that repeats SIGTERM while the server drains and closes its engine gets a clean stop,
    # not a process killed by the default handler (exit -15) with its engine half closed.
    srv = Server([], tmp_path / "serve.log")
    try:
        assert _sigterm_mid_stream(srv, 2)[-1] == "data: [DONE]"
        deadline = time.monotonic() + 60
        while srv.proc.poll() is None and time.monotonic() < deadline:
            srv.proc.send_signal(signal.SIGTERM)
            time.sleep(0.005)
        assert srv.proc.poll() == 0, srv.log.read_text()
    finally:
        srv.stop()
