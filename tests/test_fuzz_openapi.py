"""A few hundred requests generated from the server's own /openapi.json (scripts/fuzz.py): no 5xx, no
hang, every error in the OpenAI error shape, every answer valid against the schema, invalid requests
refused, and the server still answering, with every KV block free, afterwards."""
from __future__ import annotations

import asyncio
import importlib.util
import sys

import pytest
from server_helpers import KEY, ROOT, Server

pytest.importorskip("hypothesis")
pytest.importorskip("jsonschema")
httpx = pytest.importorskip("httpx")

pytestmark = pytest.mark.skipif(not (ROOT / "warploop/llm/tiny/config.json").exists(), reason="needs the tiny model")

sys.path.insert(0, str(ROOT / "scripts"))
spec = importlib.util.spec_from_file_location("fuzz", ROOT / "scripts" / "fuzz.py")
fuzz = sys.modules["fuzz"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(fuzz)

CASES = 500
AUTH = {"authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # A short context keeps every generation short; a key makes 401 reachable.
    srv = Server(["--max-model-len", "48", "--api-key", KEY], tmp_path_factory.mktemp("fuzz") / "serve.log")
    yield srv
    assert srv.stop() == 0, srv.log.read_text()


def test_schema_driven_fuzz(server):
    report = fuzz.fuzz(server.url, CASES, seed_value=0, api_key=KEY)
    print(report.summary())
    assert not report.problems, "\n".join(report.problems[:20])
    assert report.cases == CASES
    assert sum(n for s, n in report.statuses.items() if s == 200) > CASES // 5   # many reach the engine
    assert sum(n for s, n in report.statuses.items() if s == 400) > CASES // 5   # and many are refused
    log = server.log.read_text()
    assert "Traceback" not in log, log[-3000:]


def test_the_generator_covers_every_operation_and_both_kinds(server):
    doc = httpx.get(f"{server.url}/openapi.json", headers=AUTH, timeout=10).json()
    cases = fuzz.generate_cases(doc, "tiny", 120, seed_value=1)
    assert {(c.method, c.path) for c in cases} == {(m, p) for m, p, _ in fuzz.operations(doc)}
    assert any(c.valid for c in cases) and any(not c.valid for c in cases)


def test_without_the_key_every_v1_answer_is_a_documented_401(server):
    doc = httpx.get(f"{server.url}/openapi.json", headers=AUTH, timeout=10).json()
    # Paths whose parameter holds a "/" (or is empty) match no route: those are 404 before any key is asked.
    cases = [c for c in fuzz.generate_cases(doc, "tiny", 40, seed_value=2) if c.path.startswith("/v1")
             and c.url_path.count("/") == c.path.count("/") and not c.url_path.endswith("/")]
    report = asyncio.run(fuzz.run_cases(server.url, doc, cases))
    assert not report.problems, "\n".join(report.problems[:20])
    assert set(report.statuses) == {401}
