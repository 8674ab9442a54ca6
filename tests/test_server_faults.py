"""Faults of the engine's device work never hang a request (the CPU executor's equivalent of a GPU
fault: the backend's step raises, or never returns, on demand).

- A step that raises: every request in it gets an error naming the fault, and the server goes on.
- A device fault (a watchdog's TimeoutError, a CUDA error): every waiting request gets an error, then
  /health and new requests 503, and the server is told to exit (`warploop serve` exits 1, naming it).
- A step that never returns: after --engine-timeout every waiting request gets an error, the same way.
"""
from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest
from server_helpers import ROOT

httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")

pytestmark = pytest.mark.skipif(not (ROOT / "warploop/llm/tiny/config.json").exists(), reason="needs the tiny model")

ANSWER_WITHIN_S = 20


class FaultyBackend:
    """Wraps a backend's forward_sample: `raise_next` makes steps raise it; `hang` makes them block."""

    def __init__(self, backend) -> None:
        self.real = backend.forward_sample
        self.raise_next: BaseException | None = None
        self.hang = threading.Event()
        self.release = threading.Event()
        self.steps = 0
        backend.forward_sample = self

    def __call__(self, *args, **kwargs):
        self.steps += 1
        if self.steps > 3 and self.raise_next is not None:
            raise self.raise_next
        if self.steps > 3 and self.hang.is_set():
            self.release.wait(60)
        return self.real(*args, **kwargs)


class AppServer:
    """create_app over a fresh CPU tiny engine, served by uvicorn on a thread."""

    def __init__(self, engine_timeout_s: float = 600.0, **engine_options) -> None:
        """engine_options: Engine.from_model's (default: the CPU, the per-op backend)."""
        from warploop.llm.engine import Engine
        from warploop.llm.server import create_app

        self.engine = Engine.from_model("tiny", **({"device": "cpu", "num_kv_blocks": 64, "backend": "torch"}
                                                   | engine_options))
        self.fault = FaultyBackend(self.engine.backend)
        self.fatal: list[str] = []
        app = create_app(self.engine, engine_timeout_s=engine_timeout_s, on_fatal=self.fatal.append)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.05)

    def close(self) -> None:
        self.fault.release.set()
        self.server.should_exit = True
        self.thread.join(30)
        self.engine.close()


@pytest.fixture
def app_server():
    servers = []

    def make(**kw) -> AppServer:
        servers.append(AppServer(**kw))
        return servers[-1]

    yield make
    for s in servers:
        s.close()


async def four_requests(url: str) -> list[tuple[int, str]]:
    """Two streams and two non-streamed requests that generate long enough to meet the fault."""
    async with httpx.AsyncClient(base_url=url, timeout=ANSWER_WITHIN_S + 10) as client:
        async def plain(i: int) -> tuple[int, str]:
            r = await client.post("/v1/completions", json={"prompt": f"def f{i}(", "max_tokens": 200,
                                                           "ignore_eos": True})
            return r.status_code, r.text

        async def stream(i: int) -> tuple[int, str]:
            async with client.stream("POST", "/v1/chat/completions", json={
                    "messages": [{"role": "user", "content": f"x{i}"}], "max_tokens": 200, "ignore_eos": True,
                    "stream": True}) as r:
                return r.status_code, (await r.aread()).decode()

        return await asyncio.wait_for(asyncio.gather(plain(0), plain(1), stream(2), stream(3)), ANSWER_WITHIN_S)


def assert_each_failed_naming(results: list[tuple[int, str]], cause: str) -> None:
    for status, text in results:
        if status == 200:  # a stream: its status was sent before the fault; the error is its last event
            events = [e.removeprefix("data: ") for e in text.split("\n\n") if e.strip()]
            error = json.loads(events[-1])["error"]
        else:
            assert status == 500, text
            error = json.loads(text)["error"]
        assert cause in error["message"] and error["type"] == "server_error", error


def kv_blocks_used(engine) -> int:
    deadline = time.monotonic() + 10
    while engine.stats()["kv_blocks_used"] and time.monotonic() < deadline:
        time.sleep(0.05)
    return engine.stats()["kv_blocks_used"]


def test_a_failing_step_fails_its_requests_and_the_server_goes_on(app_server):
    srv = app_server()
    srv.fault.raise_next = RuntimeError("injected fault in a step")
    assert_each_failed_naming(asyncio.run(four_requests(srv.url)), "injected fault in a step")
    srv.fault.raise_next = None
    r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "def f(", "max_tokens": 4}, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    assert httpx.get(f"{srv.url}/health", timeout=5).status_code == 200
    assert srv.fatal == [] and kv_blocks_used(srv.engine) == 0


@pytest.mark.parametrize("fault", [TimeoutError("the decode loop made no step in 60 s (injected)"),
                                   RuntimeError("CUDA error: an illegal memory access was encountered (injected)")])
def test_a_device_fault_reaches_every_request_then_stops_the_server(app_server, fault):
    srv = app_server()
    srv.fault.raise_next = fault
    assert_each_failed_naming(asyncio.run(four_requests(srv.url)), "(injected)")
    assert len(srv.fatal) == 1 and type(fault).__name__ in srv.fatal[0], srv.fatal
    health = httpx.get(f"{srv.url}/health", timeout=5)
    assert health.status_code == 503 and "(injected)" in health.json()["error"]["message"]
    r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "x"}, timeout=10)
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_failed"


def test_a_hung_step_reaches_every_request_after_the_engine_timeout(app_server):
    srv = app_server(engine_timeout_s=2.0)
    srv.fault.hang.set()
    start = time.monotonic()
    assert_each_failed_naming(asyncio.run(four_requests(srv.url)), "produced no token for 2 s")
    assert time.monotonic() - start < 2.0 + 5
    assert len(srv.fatal) == 1 and "--engine-timeout" in srv.fatal[0]


def test_warploop_serve_exits_1_naming_the_fault(tmp_path):
    """The CLI end: a device fault in `warploop serve` fails the request and the process exits 1."""
    script = tmp_path / "serve_with_fault.py"
    script.write_text(f"""
import sys
sys.path[:0] = [{str(ROOT)!r}, {str(ROOT / 'tests')!r}]
from warploop.llm.engine import Engine
from test_server_faults import FaultyBackend
real = Engine.from_model
def faulty(*a, **kw):
    engine = real(*a, **kw)
    FaultyBackend(engine.backend).raise_next = TimeoutError("the resident kernel made no step in 60 s (injected)")
    return engine
Engine.from_model = faulty
from warploop.cli import main
sys.exit(main(["serve", "--model", "tiny", "--port", "0", "--log-level", "warning"]))
""")
    env = dict(os.environ, WARPLOOP_DEVICE="cpu", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=ROOT)
    try:
        line = ""
        while " on http" not in line:  # the "serving ... on URL" line
            line = proc.stdout.readline()
            assert line, f"warploop serve exited early: {proc.stderr.read()}"
        url = line.split(" on ")[1].split()[0]
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "def f(", "max_tokens": 100, "ignore_eos": True},
                       timeout=ANSWER_WITHIN_S)
        assert r.status_code == 500 and "(injected)" in r.json()["error"]["message"]
        assert proc.wait(timeout=30) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    stderr = proc.stderr.read()
    assert "warploop serve: the device failed: TimeoutError: the resident kernel made no step" in stderr, stderr
