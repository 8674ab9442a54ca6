"""warploop as a Ray Serve application (warploop/llm/ray_serve.py): its arguments are checked on the
driver (no Ray needed); with Ray (`pip install "warploop[ray]"`; CI's third job), two CPU replicas
of the tiny model behind one endpoint answer completions, streams and concurrent requests with a
local engine's greedy text, and a killed replica is replaced while the endpoint keeps answering;
scripts/serve_load.py measures two replicas on a Ray cluster of its own and stops all of it."""
import asyncio
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from warploop.llm.engine import Engine, SamplingParams
from warploop.llm.ray_serve import parse_args


def test_arguments_are_checked_on_the_driver():
    model, opts, config = parse_args({"model": "tiny", "replicas": "2", "device": "cpu", "max_num_seqs": "4",
                                      "enable_prefix_caching": "false", "num_kv_blocks": "None"})
    assert model == "tiny" and opts == {"replicas": 2}
    assert config.max_num_seqs == 4 and config.enable_prefix_caching is False and config.num_kv_blocks is None
    for bad, message in (({}, "model="), ({"model": "tiny", "replica": "2"}, "unknown argument 'replica'"),
                         ({"model": "tiny", "replicas": "two"}, "replicas='two': not a int"),
                         ({"model": "tiny", "max_num_seqs": "0"}, "--max-num-seqs"),
                         ({"model": "tiny", "replicas": 2, "max_replicas": 4}, "not both"),
                         ({"model": "tiny", "min_replicas": 3, "max_replicas": 2}, "exceeds"),
                         ({"model": "tiny", "backend": "mega"}, "is not one of")):
        with pytest.raises(ValueError, match=message):
            parse_args(bad)


def test_serve_load_measures_two_ray_replicas_and_stops_them():
    # before the module's cluster (the fixture below) starts: one local Ray cluster at a time on CI's cores
    pytest.importorskip("ray.serve")
    pytest.importorskip("httpx")
    script = Path(__file__).resolve().parents[1] / "scripts" / "serve_load.py"
    out = subprocess.run([sys.executable, str(script), "--systems", "ray", "--device", "cpu", "--model", "tiny",
                          "--concurrency", "4", "--max-tokens", "4", "--rounds", "1", "--timeout", "150"],
                         capture_output=True, text=True, timeout=300)
    assert out.stdout, out.stderr[-3000:]
    got = json.loads(out.stdout)["systems"]["ray"]
    assert out.returncode == 0, got
    assert got["tokens_per_round"] == got["expected_tokens_per_round"] == 16 and got["tok_s"] > 0, got
    assert got["stop"] == "clean", got      # serve.shutdown() and ray.shutdown() left no process behind


@pytest.fixture(scope="module")
def endpoint():
    ray = pytest.importorskip("ray")
    pytest.importorskip("ray.serve")
    from ray import serve

    from warploop.llm.ray_serve import app_builder
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(app_builder({"model": "tiny", "device": "cpu", "replicas": 2, "max_num_seqs": 4,
                               "num_kv_blocks": 64}), route_prefix="/")
        yield f"http://127.0.0.1:{port}", serve, ray
    finally:
        serve.shutdown()
        ray.shutdown()


def _running(serve) -> int:
    app = serve.status().applications["default"]
    return app.deployments["warploop"].replica_states.get("RUNNING", 0)


def _local(prompt: str, n: int) -> str:
    with Engine.from_model("tiny", device="cpu", progress=False, num_kv_blocks=64) as engine:
        return engine.generate(prompt, SamplingParams(max_tokens=n, temperature=0.0)).text


def test_two_replicas_answer_like_a_local_engine(endpoint):
    httpx = pytest.importorskip("httpx")
    url, serve, _ = endpoint
    assert _running(serve) == 2
    prompts = [f"def f{i}(" for i in range(8)]
    want = [_local(p, 12) for p in prompts]

    async def run():
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            async def one(p):
                r = await client.post("/v1/completions", json={"model": "tiny", "prompt": p, "max_tokens": 12,
                                                               "temperature": 0})
                assert r.status_code == 200, r.text
                return r.json()["choices"][0]["text"]
            texts = await asyncio.gather(*(one(p) for p in prompts))
            chunks = []
            async with client.stream("POST", "/v1/chat/completions", json={
                    "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6,
                    "temperature": 0, "stream": True}) as r:
                assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
                async for line in r.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        chunks.append(json.loads(line[6:]))
            models = (await client.get("/v1/models")).json()
            return texts, chunks, models
    texts, chunks, models = asyncio.run(run())
    assert texts == want
    assert chunks and chunks[-1]["choices"][0]["finish_reason"] in ("length", "stop")
    assert models["data"][0]["id"] == "tiny"


def test_a_killed_replica_is_replaced_and_the_endpoint_keeps_answering(endpoint):
    httpx = pytest.importorskip("httpx")
    url, serve, ray = endpoint
    from ray.util import list_named_actors
    replicas = [a for a in list_named_actors(all_namespaces=True) if "SERVE_REPLICA" in a["name"]]
    assert len(replicas) == 2
    original = {a["name"] for a in replicas}
    ray.kill(ray.get_actor(replicas[0]["name"], namespace=replicas[0]["namespace"]), no_restart=True)
    deadline = time.monotonic() + 120
    with httpx.Client(base_url=url, timeout=60) as client:
        answered = 0
        while time.monotonic() < deadline:
            r = client.post("/v1/completions", json={"model": "tiny", "prompt": "x = ", "max_tokens": 2,
                                                     "temperature": 0})
            answered += r.status_code == 200
            names = {a["name"] for a in list_named_actors(all_namespaces=True) if "SERVE_REPLICA" in a["name"]}
            if _running(serve) == 2 and len(names) == 2 and names - original:     # a new replica serves
                break
            time.sleep(0.5)
    assert _running(serve) == 2 and replicas[0]["name"] not in names and names - original, names
    assert answered >= 1
