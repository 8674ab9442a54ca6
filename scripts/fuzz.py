"""Fuzz a `warploop serve` from its own /openapi.json: every request is generated from the schema the
server publishes, and every answer is checked against it.

    python scripts/fuzz.py --cases 5000                      # starts `warploop serve --model tiny` on the CPU
    python scripts/fuzz.py --url http://127.0.0.1:8000 --cases 2000 --seed 7 [--api-key KEY]

Cases, a mix over every operation of the document:
- valid: a body (or path parameter) drawn from the schema with hypothesis; the `model` field is the
  served model or left out three times in four (any other string is a documented 404);
- invalid: a valid body with one field set to a value its schema forbids, a required field dropped,
  an unknown field, a body that is not a JSON object, or not JSON at all. The schema forbids it, so
  the server must refuse it (4xx).
Every answer: no 5xx; a status the operation documents; a content type it documents; a JSON body
valid against the documented schema (errors: the OpenAI error object); a stream whose every event is
valid against its chunk schema and which ends with [DONE]; all within the timeout (no hang).
Afterwards the server still answers and holds no KV block. Exit status 1 if any check failed.
tests/test_fuzz_openapi.py runs a few hundred cases of this in CI.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import copy
import dataclasses
import json
import random
import sys
import time
import urllib.parse
from typing import Any

import httpx
import jsonschema
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

MAX_STRING, MAX_ITEMS = 24, 4        # small values: the point is shape, not volume (soak.py does volume)
REQUEST_TIMEOUT_S = 60.0
# Values tried in place of a field; those its schema forbids are the invalid cases.
WRONG_VALUES = ["", "x", True, False, 0, -1, 1.5, 3.0, 2**64, -(2**63) - 1, [], ["x"], [0], {}, {"a": 1}, None]
WHOLE_BODY_WRONG = [b"", b"{", b"\xff\xfe", b"[]", b"1", b'"x"', b"null", b'{"a": ', b"{}"]


@dataclasses.dataclass
class Case:
    method: str
    path: str            # the operation's path template
    url_path: str        # with its parameters filled in
    body: bytes | None
    valid: bool          # whether the request satisfies the schema
    what: str            # how it was made (for the report)


def resolve(doc: dict, schema: dict) -> dict:
    while "$ref" in schema:
        schema = doc["components"]["schemas"][schema["$ref"].rsplit("/", 1)[1]]
    return schema


def validator(doc: dict, schema: dict) -> jsonschema.Draft202012Validator:
    """A validator of `schema`, whose $refs point into the document's components."""
    return jsonschema.Draft202012Validator({**schema, "components": doc["components"]})


def values(doc: dict, schema: dict) -> st.SearchStrategy:
    """JSON values valid against `schema` (the subset of JSON Schema pydantic emits)."""
    schema = resolve(doc, schema)
    branches = schema.get("anyOf") or schema.get("oneOf")
    if branches:
        # Keywords beside anyOf apply to every branch (pydantic puts field-level bounds there).
        shared = {k: v for k, v in schema.items() if k not in ("anyOf", "oneOf", "default", "description", "title")}
        return st.one_of([values(doc, {**shared, **resolve(doc, b)}) for b in branches])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    if "const" in schema:
        return st.just(schema["const"])
    kind = schema.get("type")
    if kind == "null":
        return st.none()
    if kind == "boolean":
        return st.booleans()
    if kind == "integer":
        return st.integers(min_value=schema.get("minimum"), max_value=schema.get("maximum"))
    if kind == "number":
        low = schema.get("minimum", schema.get("exclusiveMinimum"))
        return st.floats(min_value=low, max_value=schema.get("maximum"), allow_nan=False, allow_infinity=False,
                         exclude_min="exclusiveMinimum" in schema and "minimum" not in schema)
    if kind == "string":
        return st.text(min_size=schema.get("minLength", 0),
                       max_size=min(schema.get("maxLength", MAX_STRING), max(MAX_STRING, schema.get("minLength", 0))))
    if kind == "array":
        low = schema.get("minItems", 0)
        return st.lists(values(doc, schema.get("items", {})), min_size=low,
                        max_size=min(schema.get("maxItems", MAX_ITEMS), max(MAX_ITEMS, low)))
    if kind == "object":
        props = schema.get("properties", {})
        required = {k: values(doc, props[k]) for k in schema.get("required", [])}
        optional = {k: values(doc, v) for k, v in props.items() if k not in required}
        fixed = st.fixed_dictionaries(required, optional=optional)
        extra = schema.get("additionalProperties", True)
        if props or extra is False or schema.get("maxProperties") == 0:
            return fixed
        value = values(doc, extra) if isinstance(extra, dict) else _any_json()
        return st.dictionaries(st.text(max_size=8), value, max_size=schema.get("maxProperties", MAX_ITEMS))
    return _any_json()


def _any_json() -> st.SearchStrategy:
    scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(
        max_size=8)
    return st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4),
                                                                                            inner, max_size=3),
                        max_leaves=6)


def operations(doc: dict) -> list[tuple[str, str, dict]]:
    return [(method.upper(), path, op) for path, item in doc["paths"].items() for method, op in item.items()]


def _mutations(doc: dict, request_schema: dict, body: dict) -> list[tuple[str, Any]]:
    """(description, new body) for every way of breaking `body` that the schema forbids."""
    schema = resolve(doc, request_schema)
    check = validator(doc, request_schema)
    out: list[tuple[str, Any]] = []
    for name, field in schema["properties"].items():
        field_check = validator(doc, field)
        for wrong in WRONG_VALUES:
            if not field_check.is_valid(wrong):
                out.append((f"{name}={json.dumps(wrong)}", {**body, name: wrong}))
    for name in schema.get("required", []):
        out.append((f"without {name}", {k: v for k, v in body.items() if k != name}))
    out.append(("unknown field", {**body, "no_such_field": 1}))
    return [(what, b) for what, b in out if not check.is_valid(b)]


def _segment(value: str) -> str:
    """A path parameter as one URL segment: a client would resolve a bare "." or ".." away (RFC 3986)."""
    return urllib.parse.quote(value, safe="").replace(".", "%2E")


def _draw(strategy: st.SearchStrategy, count: int, seed_value: int) -> list[Any]:
    """Up to `count` values of `strategy`, reproducibly from `seed_value`."""
    drawn: list[Any] = []

    @seed(seed_value)
    @settings(max_examples=count, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def draw(value: Any) -> None:
        drawn.append(value)

    draw()
    return drawn


def generate_cases(doc: dict, served_model: str, count: int, seed_value: int) -> list[Case]:
    """`count` cases over every operation of `doc`, drawn with hypothesis from seed `seed_value`."""
    ops = operations(doc)
    rng = random.Random(seed_value)
    cases: list[Case] = []

    def body_strategy(op: dict) -> st.SearchStrategy:
        return values(doc, op["requestBody"]["content"]["application/json"]["schema"])

    def param_strategy(op: dict) -> st.SearchStrategy:
        params = {p["name"]: values(doc, p["schema"]) | st.just(served_model) for p in op.get("parameters", [])
                  if p["in"] == "path"}
        return st.fixed_dictionaries(params)

    strategies = {(m, p): (body_strategy(op) if "requestBody" in op else param_strategy(op)) for m, p, op in ops}
    per_op = -(-count // len(ops))
    for method, path, op in ops:
        drawn = _draw(strategies[(method, path)], per_op, seed_value)
        # A small space (no parameters at all) ends hypothesis early: its values are sent again.
        for i in range(per_op):
            value = copy.deepcopy(drawn[i % len(drawn)])
            if "requestBody" not in op:
                url_path = path.format(**{k: _segment(str(v)) for k, v in value.items()})
                cases.append(Case(method, path, url_path, None, True, f"path {value}"))
                continue
            if rng.random() < 0.75:
                value.pop("model", None)
                if rng.random() < 0.5:
                    value["model"] = served_model
            request_schema = op["requestBody"]["content"]["application/json"]["schema"]
            roll = rng.random()
            if roll < 0.6:
                cases.append(Case(method, path, path, json.dumps(value).encode(), True, "valid body"))
            elif roll < 0.9:
                what, broken = rng.choice(_mutations(doc, request_schema, value))
                cases.append(Case(method, path, path, json.dumps(broken).encode(), False, what))
            else:
                raw = rng.choice(WHOLE_BODY_WRONG)
                cases.append(Case(method, path, path, raw, False, f"body {raw!r}"))
    rng.shuffle(cases)
    return cases[:count]


def _documented(doc: dict, case: Case, status: int) -> dict | None:
    return doc["paths"][case.path][case.method.lower()]["responses"].get(str(status))


def check_answer(doc: dict, case: Case, status: int, content_type: str, raw: bytes) -> str | None:
    """What is wrong with the answer to `case`, or None."""
    if status >= 500:
        return f"{status} (a server error)"
    if not case.valid and status < 400:
        return f"{status} for a request the schema forbids"
    documented = _documented(doc, case, status)
    if documented is None:
        return f"{status} is not documented for {case.method} {case.path}"
    media = content_type.split(";")[0].strip()
    if media not in documented.get("content", {}):
        return f"content type {media!r} is not documented for {status}"
    entry = documented["content"][media]
    if media == "application/json":
        try:
            body = json.loads(raw)
        except ValueError:
            return f"{status}: the body is not JSON: {raw[:200]!r}"
        errors = sorted(validator(doc, entry["schema"]).iter_errors(body), key=str)
        return f"{status}: {errors[0].message} in {json.dumps(body)[:300]}" if errors else None
    if media == "text/event-stream":
        return _check_stream(doc, entry, raw)
    return None


def _check_stream(doc: dict, entry: dict, raw: bytes) -> str | None:
    events = [line.removeprefix("data: ") for line in raw.decode().split("\n\n") if line.strip()]
    if not events or events[-1] != "[DONE]":
        return f"the stream does not end with [DONE]: {raw[-200:]!r}"
    chunk = validator(doc, entry["x-sse-data"])
    for event in events[:-1]:
        body = json.loads(event)
        if "error" in body:
            return f"the stream carried an error: {event[:300]}"
        errors = list(chunk.iter_errors(body))
        if errors:
            return f"stream event: {errors[0].message} in {event[:300]}"
    return None


@dataclasses.dataclass
class Report:
    cases: int = 0
    statuses: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    problems: list[str] = dataclasses.field(default_factory=list)
    seconds: float = 0.0

    def summary(self) -> str:
        by_status = ", ".join(f"{s}: {n}" for s, n in sorted(self.statuses.items()))
        return f"{self.cases} cases in {self.seconds:.1f} s ({by_status}); {len(self.problems)} problems"


async def run_cases(url: str, doc: dict, cases: list[Case], headers: dict[str, str] | None = None,
                    concurrency: int = 16) -> Report:
    report, gate = Report(), asyncio.Semaphore(concurrency)
    start = time.perf_counter()
    async with httpx.AsyncClient(base_url=url, timeout=REQUEST_TIMEOUT_S, headers=headers or {}) as client:
        async def one(case: Case) -> None:
            async with gate:
                try:
                    content = {"content": case.body, "headers": {"content-type": "application/json"}} \
                        if case.body is not None else {}
                    r = await asyncio.wait_for(client.request(case.method, case.url_path, **content),
                                               REQUEST_TIMEOUT_S)
                except (TimeoutError, httpx.TimeoutException):
                    report.problems.append(f"{case.method} {case.url_path} ({case.what}): no answer within "
                                           f"{REQUEST_TIMEOUT_S:g} s; body {case.body[:300] if case.body else b''!r}")
                    return
                except httpx.TransportError as exc:
                    report.problems.append(f"{case.method} {case.url_path} ({case.what}): {exc!r}")
                    return
            report.cases += 1
            report.statuses[r.status_code] += 1
            problem = check_answer(doc, case, r.status_code, r.headers.get("content-type", ""), r.content)
            if problem:
                body = case.body[:300] if case.body else b""
                report.problems.append(f"{case.method} {case.url_path} ({case.what}): {problem}; request {body!r}")

        await asyncio.gather(*(one(c) for c in cases))
    report.seconds = time.perf_counter() - start
    return report


def server_still_answers(url: str, headers: dict[str, str] | None = None, idle_timeout_s: float = 30) -> str | None:
    """None if the server answers /health and a completion and holds no KV block; else what is wrong."""
    headers = headers or {}
    try:
        if httpx.get(f"{url}/health", timeout=10).status_code != 200:
            return "/health does not answer 200"
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "def f(", "max_tokens": 4, "temperature": 0},
                       headers=headers, timeout=60)
        if r.status_code != 200:
            return f"a good completion got {r.status_code}: {r.text[:300]}"
        deadline = time.monotonic() + idle_timeout_s
        while True:
            metrics = httpx.get(f"{url}/metrics", timeout=10).text
            used = next(float(line.split()[-1]) for line in metrics.splitlines()
                        if line.startswith("warploop_kv_blocks_used "))
            if used == 0:
                return None
            if time.monotonic() > deadline:
                return f"{used:g} KV blocks still held {idle_timeout_s:g} s after the last request"
            time.sleep(0.2)
    except httpx.TransportError as exc:
        return f"the server stopped answering: {exc!r}"


def fuzz(url: str, cases: int, seed_value: int, api_key: str | None = None, concurrency: int = 16) -> Report:
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    doc = httpx.get(f"{url}/openapi.json", headers=headers, timeout=30).json()
    served = httpx.get(f"{url}/v1/models", headers=headers, timeout=30).json()["data"][0]["id"]
    report = asyncio.run(run_cases(url, doc, generate_cases(doc, served, cases, seed_value), headers, concurrency))
    after = server_still_answers(url, headers)
    if after:
        report.problems.append(f"after the cases: {after}")
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="a running server (default: start `warploop serve --model tiny` on the CPU)")
    parser.add_argument("--cases", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--api-key")
    parser.add_argument("--concurrency", type=int, default=16)
    args = parser.parse_args()
    if args.url:
        report = fuzz(args.url, args.cases, args.seed, args.api_key, args.concurrency)
    else:
        from soak import serving

        with serving(["--max-model-len", "64"]) as url:
            report = fuzz(url, args.cases, args.seed, None, args.concurrency)
    for problem in report.problems:
        print(problem)
    print(json.dumps({"cases": report.cases, "seconds": round(report.seconds, 1), "problems": len(report.problems),
                      "statuses": {str(k): v for k, v in sorted(report.statuses.items())}}))
    return 1 if report.problems else 0


if __name__ == "__main__":
    sys.exit(main())
