"""scripts/serve_load.py on the CPU (the tiny model, a few small requests): `warploop serve` with one
engine and with two replicas each answer a round of concurrent completions, counted token for token,
before a GPU run spends device time on issue 36's figure; a system that fails records its error and
log, and the next still runs. The `ray` system's test is in tests/test_ray_serve.py (it needs Ray)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("httpx")
pytest.importorskip("uvicorn")
SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "serve_load.py"
SMOKE = ["--device", "cpu", "--concurrency", "4", "--max-tokens", "6", "--rounds", "1", "--timeout", "90"]


def run(*args: str) -> tuple[int, dict]:
    out = subprocess.run([sys.executable, str(SCRIPT), *SMOKE, *args], capture_output=True, text=True, timeout=240)
    assert out.stdout, out.stderr[-3000:]
    return out.returncode, json.loads(out.stdout)


def test_one_engine_and_two_replicas_serve_a_counted_round(tmp_path):
    """Also --profile, with a stand-in for py-spy that writes its arguments where it is told: one
    recording of each Python process of a system's group (the server; the replicas' engines too)."""
    spy = tmp_path / "py-spy"
    spy.write_text(f"#!{sys.executable}\nimport sys\nargs = sys.argv[1:]\n"
                   "open(args[args.index('-o') + 1], 'w').write(' '.join(args))\n")
    spy.chmod(0o755)
    rc, got = run("--model", "tiny", "--systems", "one,replicas", "--profile", str(tmp_path / "prof"),
                  "--py-spy", str(spy))
    assert rc == 0, got
    for name, at_least in (("one", 1), ("replicas", 3)):
        recorded = [f.read_text() for f in (tmp_path / "prof").glob(f"serve-{name}-*.txt")]
        assert got["systems"][name]["profiled"] and len(recorded) >= at_least, (name, recorded)
        assert all(r.startswith("record --pid ") and "--format raw" in r for r in recorded)
    assert got["engine"] == {"max_num_seqs": 64, "max_model_len": 1024, "enable_prefix_caching": False,
                             "device": "cpu"}
    for name in ("one", "replicas"):
        system = got["systems"][name]
        assert system["tok_s"] > 0 and system["ready_s"] > 0, system
        assert isinstance(system["settle_s"], float) and system["settle_s"] >= 0, system  # the gauge read 0
        # each round's steps, from /metrics: every token after a prompt's first is a decode step's (or a loop's)
        steps = system["per_round"]
        assert steps["prefill_steps"] >= 1 and steps["decode_steps"] + steps["decode_loop_tokens"] >= 6 - 1, steps
        assert system["tokens_per_round"] == system["expected_tokens_per_round"] == 4 * 6, system
        assert system["short_completions"] == 0
        assert 0 < system["latency_p50_s"] <= system["latency_p99_s"]
        assert system["stop"] == "clean", system       # SIGTERM to the server stopped all it started
    one, replicas = got["systems"]["one"]["tok_s"], got["systems"]["replicas"]["tok_s"]
    assert got["ratio"]["replicas"] == pytest.approx(replicas / one, rel=1e-2)


def test_profile_without_py_spy_is_refused_naming_the_flag(tmp_path):
    out = subprocess.run([sys.executable, str(SCRIPT), *SMOKE, "--model", "tiny", "--profile", str(tmp_path),
                          "--py-spy", str(tmp_path / "nowhere")], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--profile needs py-spy" in out.stderr and not out.stdout


def test_a_system_that_fails_records_its_error_and_the_next_runs(tmp_path):
    rc, got = run("--model", str(tmp_path / "missing"), "--systems", "one,replicas")
    assert rc == 1
    for name in ("one", "replicas"):
        error = got["systems"][name]
        assert error["error"].startswith(f"RuntimeError: {name}: the server exited with code"), error
        assert any("missing" in line for line in error["log"]), error
    assert got["ratio"] == {}


def test_the_in_process_peers_run_the_same_counted_rounds():
    """`engine` and `pool`: the same engines and rounds with no HTTP (one Engine, a ReplicaPool of
    two), each request's tokens counted; the ratio of the two engines to one is reported."""
    rc, got = run("--model", "tiny", "--systems", "engine,pool")
    assert rc == 0, got
    for name in ("engine", "pool"):
        system = got["systems"][name]
        assert system["tokens_per_round"] == system["expected_tokens_per_round"] == 4 * 6, system
        assert system["short_completions"] == 0 and system["tok_s"] > 0 and system["stop"] == "clean", system
        assert isinstance(system["settle_s"], float), system
        assert system["per_round"]["prefill_steps"] >= 1, system
    assert got["ratio"]["pool_over_engine"] == pytest.approx(
        got["systems"]["pool"]["tok_s"] / got["systems"]["engine"]["tok_s"], rel=1e-2)


def test_the_load_client_reads_sized_chunked_and_closing_replies():
    """serve_rounds.Client (HTTP/1.1 on asyncio streams): a Content-Length body on a kept connection, a
    chunked one, and one that runs to the connection's end (which is then not reused)."""
    import asyncio

    sys.path.insert(0, str(SCRIPT.parent))
    from serve_rounds import Client

    replies = [b"HTTP/1.1 200 OK\r\nContent-Length: 7\r\n\r\n{\"a\":1}",
               b"HTTP/1.1 201 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\n{\"b\r\n4\r\n\":2}\r\n0\r\n\r\n",
               b"HTTP/1.1 503 No\r\nConnection: close\r\n\r\nbusy"]
    seen = []

    async def handle(reader, writer):
        while replies:
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0])
            seen.append(head.split(b" ")[0] + b" " + await reader.readexactly(length))
            writer.write(replies.pop(0))
            await writer.drain()
            if b"close" in head or not replies:
                break
        writer.close()

    async def main():
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        client = Client(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}")
        got = [await client.post("/x", {"p": 1}), await client.get("/m"), await client.get("/m")]
        await client.aclose()
        server.close()
        return got

    got = asyncio.run(main())
    assert [(r.status_code, r.content) for r in got] == [(200, b'{"a":1}'), (201, b'{"b":2}'), (503, b"busy")]
    assert got[0].json() == {"a": 1} and seen == [b'POST {"p": 1}', b"GET ", b"GET "]


def test_the_load_client_asks_again_where_the_server_closed_a_kept_connection():
    """A server's keep-alive timeout closes an idle connection the client keeps: the next request on
    it gets no reply at all, and goes again on a new connection (measured on the GPU machine: the
    settle wait outlasted uvicorn's 5 s, and the next round failed with IncompleteReadError)."""
    import asyncio

    sys.path.insert(0, str(SCRIPT.parent))
    from serve_rounds import Client

    async def handle(reader, writer):      # one reply a connection, then it closes without a word
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        writer.close()

    async def main():
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        client = Client(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}")
        first = await client.get("/m")
        await asyncio.sleep(0.1)           # the server has closed the kept connection
        second = await client.get("/m")
        await client.aclose()
        server.close()
        return first, second

    first, second = asyncio.run(main())
    assert (first.status_code, first.content, second.status_code, second.content) == (200, b"ok", 200, b"ok")
