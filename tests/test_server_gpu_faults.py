"""Faults inside the streaming kernel on a GPU never hang a request (skips without a Hopper GPU).
The tiny model on `--backend stream`; one greedy request at a time, so each decode runs as a loop in
the kernel. The fault is real, injected into the kernel's instruction words: one wait asks for more
signals than its producers ever give.

- The kernel's bounded wait gives up (StreamError): the requests of that launch fail naming it, the
  executor starts afresh, and once the words are put back the server answers again.
- A launch that outlives the backend's watchdog (TimeoutError): a device fault, so the request
  fails, /health says 503, and the server is told to exit.
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
httpx = pytest.importorskip("httpx")

from test_server_faults import AppServer, kv_blocks_used  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                                reason="needs a Hopper GPU")

SPIN_GIVES_UP_S = 120        # the kernel's bounded wait (StreamConfig.spin polls) gives up well within this


@pytest.fixture
def stream_server():
    """An AppServer over the tiny model on the GPU's streaming backend."""
    srv = AppServer(device="cuda", dtype="bfloat16", backend="stream")
    yield srv
    srv.close()


def unmet_wait(engine) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Make the first GEMV instruction with a wait need twice its producers' signals, plus one, in
    every executor of the batch-1 decoder: the wait is never met. Returns (words, original) pairs."""
    from warploop.runtime.stream.kinds import GEMV, WORDS, header_word
    saved, dec = [], engine.backend.decoder
    assert engine.settle(60), f"split levels {dec._deferred} still unbuilt after 60 s"   # built while idle
    for ex in dec.executors.values():
        w = ex.words.view(-1, WORDS)
        host = w.cpu()
        row = next(r for r in range(host.shape[0] - 1) if int(host[r, 0]) == GEMV.opcode
                   and int(host[r, header_word("wait0")]) >= 0 and int(host[r, header_word("need0")]) > 0)
        saved.append((ex.words, ex.words.clone()))
        w[row, header_word("need0")] = 2 * int(host[row, header_word("need0")]) + 1
    torch.cuda.synchronize()
    return saved


def greedy(url: str, timeout: float) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"prompt": "def f(", "max_tokens": 24, "temperature": 0,
                                                    "ignore_eos": True}, timeout=timeout)


def test_a_wait_that_gives_up_fails_its_request_and_the_server_goes_on(stream_server):
    srv = stream_server
    ok = greedy(srv.url, 120)
    assert ok.status_code == 200, ok.text
    saved = unmet_wait(srv.engine)
    r = greedy(srv.url, SPIN_GIVES_UP_S)
    assert r.status_code == 500 and "gave up" in r.json()["error"]["message"], r.text
    assert srv.fatal == []
    for words, original in saved:
        words.copy_(original)
    again = greedy(srv.url, 120)
    assert again.status_code == 200 and again.json()["choices"][0]["text"] == ok.json()["choices"][0]["text"]
    assert httpx.get(f"{srv.url}/health", timeout=5).status_code == 200
    assert kv_blocks_used(srv.engine) == 0


def test_a_launch_that_outlives_its_watchdog_stops_the_server(stream_server):
    srv = stream_server
    assert greedy(srv.url, 120).status_code == 200
    srv.engine.backend.timeout = 2.0        # the decode loop's watchdog (StreamBackend.timeout)
    unmet_wait(srv.engine)
    r = greedy(srv.url, 60)
    assert r.status_code == 500 and "TimeoutError" in r.json()["error"]["message"], r.text
    assert len(srv.fatal) == 1 and "TimeoutError" in srv.fatal[0], srv.fatal
    health = httpx.get(f"{srv.url}/health", timeout=5)
    assert health.status_code == 503 and health.json()["error"]["code"] == "engine_failed"
