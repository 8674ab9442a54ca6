"""What one client may hold: body size (413), time to send headers (closed) and body (408), open
connections (503), and the open-files limit. One `warploop serve --model tiny` with small limits,
started under a low open-files limit so that the cap must be fitted below it."""
from __future__ import annotations

import json
import resource
import socket
import threading
import time

import pytest
from server_helpers import ROOT, Server

httpx = pytest.importorskip("httpx")

pytestmark = pytest.mark.skipif(not (ROOT / "warploop/llm/tiny/config.json").exists(), reason="needs the tiny model")

MAX_BODY = 1_000_000
HEADER_TIMEOUT = 1.0
BODY_TIMEOUT = 2.0
FD_LIMIT = 256          # the server's open-files limit: its default --max-connections (512) does not fit
FITTED = FD_LIMIT - 128  # server_limits.RESERVED_FDS


def low_fd_limit() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (FD_LIMIT, FD_LIMIT))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = Server(["--max-body-bytes", str(MAX_BODY), "--header-timeout", str(HEADER_TIMEOUT),
                  "--body-timeout", str(BODY_TIMEOUT)], tmp_path_factory.mktemp("limits") / "serve.log",
                 preexec_fn=low_fd_limit)
    yield srv
    assert srv.stop() == 0, srv.log.read_text()


def connect(server: Server) -> socket.socket:
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=10)


def read_response(sock: socket.socket, timeout_s: float = 10) -> tuple[int, dict]:
    sock.settimeout(timeout_s)
    data = b""
    while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < _length(data):
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def _length(data: bytes) -> int:
    for line in data.split(b"\r\n\r\n", 1)[0].split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return int(line.split(b":")[1])
    return 0


def closed_by_server(sock: socket.socket, within_s: float) -> bool:
    sock.settimeout(within_s)
    try:
        return sock.recv(1024) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def health_latency(server: Server) -> float:
    start = time.perf_counter()
    assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
    return time.perf_counter() - start


def post_head(length: int | None) -> bytes:
    size = f"Content-Length: {length}" if length is not None else "Transfer-Encoding: chunked"
    return f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{size}\r\n\r\n".encode()


def test_fd_limit_fits_the_connection_cap(server):
    assert f"serving at most {FITTED} connections" in server.log.read_text()


@pytest.mark.parametrize("declared", [True, False])
def test_50mb_body_gets_413_while_health_answers(server, declared):
    sock = connect(server)
    stop = threading.Event()

    def send_body():  # 50 MB, in chunks, until the server stops reading
        chunk = b"x" * (1 << 20)
        try:
            sock.sendall(post_head(50 << 20 if declared else None))
            for _ in range(50):
                if stop.is_set():
                    return
                sock.sendall(chunk if declared else b"%x\r\n%s\r\n" % (len(chunk), chunk))
        except OSError:
            pass  # the server answered and closed: exactly what is tested

    sender = threading.Thread(target=send_body, daemon=True)
    sender.start()
    try:
        assert health_latency(server) < 1
        status, body = read_response(sock)
        assert status == 413 and body["error"]["code"] == "body_too_large"
        assert "--max-body-bytes" in body["error"]["message"]
        assert closed_by_server(sock, 5)
        assert health_latency(server) < 1
    finally:
        stop.set()
        sender.join(10)
        sock.close()


def test_large_prompt_under_the_body_limit_is_refused_without_stalling(server):
    prompt = "def f(x):\n    return x\n" * 36_000  # 0.9 MB of JSON: far more than the tiny context holds
    start = time.perf_counter()
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": prompt}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert time.perf_counter() - start < 5


def test_slowloris_headers_are_cut_off(server):
    socks = [connect(server) for _ in range(20)]
    try:
        for s in socks:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        start = time.monotonic()
        for _ in range(3):  # keep trickling: the deadline is for the whole head, not per byte
            time.sleep(0.3)
            for s in socks:
                try:
                    s.sendall(b"X-Slow: 1\r\n")
                except OSError:
                    pass
        assert health_latency(server) < 1
        assert all(closed_by_server(s, HEADER_TIMEOUT + 2) for s in socks)
        assert time.monotonic() - start < HEADER_TIMEOUT + 3
    finally:
        for s in socks:
            s.close()


def test_slow_body_gets_408(server):
    with connect(server) as sock:
        sock.sendall(post_head(100) + b'{"prompt": ')
        start = time.monotonic()
        status, body = read_response(sock, BODY_TIMEOUT + 5)
        assert status == 408 and body["error"]["code"] == "body_timeout"
        assert BODY_TIMEOUT - 0.5 < time.monotonic() - start < BODY_TIMEOUT + 3
        assert closed_by_server(sock, 5)


def test_connections_past_the_cap_get_503_and_no_emfile_traceback(server):
    held = []
    try:
        for _ in range(FITTED + 40):
            held.append(connect(server))
        time.sleep(0.5)
        refused = []
        for s in held[-40:]:
            s.settimeout(5)
            refused.append(s.recv(4096))
        assert all(r.startswith(b"HTTP/1.1 503") and b"too_many_connections" in r for r in refused)
    finally:
        for s in held:
            s.close()
    deadline = time.monotonic() + 10
    while True:  # the server sees the closes asynchronously
        try:
            if httpx.get(f"{server.url}/health", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline
        time.sleep(0.2)
    log = server.log.read_text()
    assert "Too many open files" not in log and "Traceback" not in log, log[-3000:]


def test_the_socket_listens_before_the_serving_line_is_printed():
    """`warploop serve` prints its URL before uvicorn starts; a client that connects at once (a script
    waiting for that line) must wait in the backlog, not be refused (seen on a GPU: ConnectionRefused)."""
    from warploop.llm.server_cli import bind

    sock = bind("127.0.0.1", 0)
    try:
        with socket.create_connection(sock.getsockname()[:2], timeout=5):
            pass
    finally:
        sock.close()
