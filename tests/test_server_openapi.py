"""/openapi.json documents the API the handlers implement: request bodies from the pydantic models
they validate with, every status they answer with the OpenAI error object, and the stream's content
type. Built from the app alone (a stub engine): no model is loaded."""
from __future__ import annotations

import pytest

from warploop.llm.server import create_app

GENERATE = ("/v1/completions", "/v1/chat/completions")


class StubEngine:
    model_name, max_context, tokenizer = "stub", 512, None

    def stats(self) -> dict:
        return {}


@pytest.fixture(scope="module")
def doc() -> dict:
    return create_app(StubEngine()).openapi()


def resolve(doc: dict, schema: dict) -> dict:
    name = schema["$ref"].removeprefix("#/components/schemas/")
    return doc["components"]["schemas"][name]


def test_the_document_is_valid_openapi(doc):
    validator = pytest.importorskip("openapi_spec_validator")
    validator.validate(doc)
    validator.validate(create_app(StubEngine(), api_key="k").openapi())


@pytest.mark.parametrize("path,fields", [
    ("/v1/completions", {"prompt", "max_tokens", "temperature", "stream", "stop", "top_k", "seed"}),
    ("/v1/chat/completions", {"messages", "max_tokens", "max_completion_tokens", "stream_options", "top_p"}),
])
def test_request_bodies_come_from_the_models(doc, path, fields):
    body = doc["paths"][path]["post"]["requestBody"]
    assert body["required"]
    schema = resolve(doc, body["content"]["application/json"]["schema"])
    assert fields <= set(schema["properties"])
    assert schema["additionalProperties"] is False  # unknown fields are a 400
    required = {"/v1/completions": ["prompt"], "/v1/chat/completions": ["messages"]}[path]
    assert schema["required"] == required
    # What is parsed but refused is published as such: n only 1, penalties only 0.
    assert schema["properties"]["n"]["enum"] == [1]
    assert schema["properties"]["presence_penalty"]["enum"] == [0.0]


@pytest.mark.parametrize("path,method,statuses", [
    ("/v1/completions", "post", {200, 400, 401, 404, 408, 413, 500, 503}),
    ("/v1/chat/completions", "post", {200, 400, 401, 404, 408, 413, 500, 503}),
    ("/v1/models", "get", {200, 401, 503}),
    ("/v1/models/{model}", "get", {200, 401, 404, 503}),
    ("/health", "get", {200, 503}),
    ("/metrics", "get", {200, 503}),
])
def test_every_status_is_documented_with_the_error_shape(doc, path, method, statuses):
    responses = doc["paths"][path][method]["responses"]
    assert {int(s) for s in responses} == statuses
    assert "422" not in responses  # FastAPI validates nothing here, so it never answers 422
    for status, response in responses.items():
        if status != "200":
            error = resolve(doc, response["content"]["application/json"]["schema"])
            assert set(error["properties"]) == {"error"}
            detail = resolve(doc, error["properties"]["error"])
            assert set(detail["required"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("path", GENERATE)
def test_streams_are_documented_as_server_sent_events(doc, path):
    content = doc["paths"][path]["post"]["responses"]["200"]["content"]
    assert set(content) == {"application/json", "text/event-stream"}
    chunk = resolve(doc, content["text/event-stream"]["x-sse-data"])
    assert chunk["properties"]["object"]["const"].endswith(("text_completion", "chunk"))


def test_with_an_api_key_v1_routes_declare_bearer_auth():
    doc = create_app(StubEngine(), api_key="k").openapi()
    assert doc["components"]["securitySchemes"]["bearer"] == {"type": "http", "scheme": "bearer"}
    assert all(op["security"] == [{"bearer": []}] for p, item in doc["paths"].items() if p.startswith("/v1")
               for op in item.values())
    assert "security" not in doc["paths"]["/health"]["get"]
