"""The published API: what /openapi.json says of every route, built from the same pydantic models the
handlers validate with.

The handlers parse request bodies themselves (off the event loop, with errors that name the field:
server_prepare.py), so FastAPI sees no body parameter; each route instead declares its body, its
answers and their content types here (`route_docs`). The response models below document what the
handlers return (tests/test_fuzz_openapi.py checks every answer against them); every error, whatever
its status, is `ErrorResponse`.
"""
from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict, Field
from pydantic.json_schema import models_json_schema

from warploop.llm.openai_schema import ChatCompletionRequest, CompletionRequest

REF = "#/components/schemas/{model}"


class _Closed(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ErrorDetail(_Closed):
    message: str = Field(description="what went wrong and what to change")
    type: str = Field(description="invalid_request_error, or server_error for a failure of the server")
    param: str | None = Field(description="the request field at fault (dotted path), if one is")
    code: str | None = Field(description="e.g. invalid_json, context_length_exceeded, body_too_large, "
                                         "invalid_api_key, model_not_found, aborted")


class ErrorResponse(_Closed):
    """OpenAI's error object: every status other than 200 carries one."""
    error: ErrorDetail


class Usage(_Closed):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


FinishReason = Literal["stop", "length"]


class CompletionChoice(_Closed):
    index: int
    text: str
    logprobs: None
    finish_reason: FinishReason


class Completion(_Closed):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class CompletionChunkChoice(_Closed):
    index: int
    text: str
    logprobs: None
    finish_reason: FinishReason | None


class CompletionChunk(_Closed):
    """One `data:` event of a completions stream; with stream_options.include_usage the last one has
    no choices and carries `usage`."""
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChunkChoice]
    usage: Usage | None = None


class AssistantMessage(_Closed):
    role: Literal["assistant"]
    content: str


class ChatChoice(_Closed):
    index: int
    message: AssistantMessage
    logprobs: None
    finish_reason: FinishReason


class ChatCompletion(_Closed):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(_Closed):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(_Closed):
    index: int
    delta: ChatDelta
    logprobs: None
    finish_reason: FinishReason | None


class ChatCompletionChunk(_Closed):
    """One `data:` event of a chat stream; the first has delta {"role": "assistant", "content": ""}."""
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(_Closed):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class ModelList(_Closed):
    object: Literal["list"]
    data: list[ModelCard]


class Health(_Closed):
    status: Literal["ok"]
    model: str


MODELS = (CompletionRequest, ChatCompletionRequest, ErrorResponse, Completion, CompletionChunk, ChatCompletion,
          ChatCompletionChunk, ModelCard, ModelList, Health)

# Every status a route may answer besides 200, and why.
ERRORS = {
    400: "the body is not JSON, a field is missing, unknown, of the wrong JSON type, out of range or not "
         "supported, or the prompt does not fit the context; `param` names the field",
    401: "missing or wrong API key (only when the server runs with --api-key)",
    404: "the model named is not the one served (`param`: model)",
    408: "the body did not arrive within --body-timeout",
    413: "the body is larger than --max-body-bytes",
    500: "the engine failed this request (alone: the rest of its batch is rerun without it)",
    503: "the engine aborted the request (shutting down, or its GPU work failed: `code` aborted), or the "
         "server holds --max-connections connections",
}
ALWAYS = (503,)  # any connection may be refused before its request is read


def _ref(model: type) -> dict:
    return {"$ref": REF.format(model=model.__name__)}


def _errors(*statuses: int) -> dict[int, dict]:
    return {s: {"description": ERRORS[s], "content": {"application/json": {"schema": _ref(ErrorResponse)}}}
            for s in sorted({*statuses, *ALWAYS})}


def _ok(model: type, description: str) -> dict[int, dict]:
    return {200: {"description": description, "content": {"application/json": {"schema": _ref(model)}}}}


def route_docs(route: str) -> dict[str, Any]:
    """Keyword arguments of the FastAPI route decorator: `responses` and, for POST routes, the body
    (response_model None: the handlers' return annotations are not what they document)."""
    return {"response_model": None, **_route_docs(route)}


def _route_docs(route: str) -> dict[str, Any]:
    if route in ("/v1/completions", "/v1/chat/completions"):
        chat = route == "/v1/chat/completions"
        request, answer, chunk = ((ChatCompletionRequest, ChatCompletion, ChatCompletionChunk) if chat
                                  else (CompletionRequest, Completion, CompletionChunk))
        # OpenAPI 3.1 has no schema for the events of a stream (3.2's itemSchema); x-sse-data names it.
        stream = {"schema": {"type": "string", "description": f"with stream: true, server-sent events: "
                             f"`data: <{chunk.__name__}>` per chunk, then `data: [DONE]`; an engine failure "
                             "mid-stream is one `data: <ErrorResponse>` event and the stream ends"},
                  "x-sse-data": _ref(chunk)}
        ok = _ok(answer, f"the {answer.__name__} (stream: false) or its chunks as server-sent events (stream: true)")
        ok[200]["content"]["text/event-stream"] = stream
        body = {"required": True, "content": {"application/json": {"schema": _ref(request)}}}
        return {"responses": {**ok, **_errors(400, 401, 404, 408, 413, 500)}, "openapi_extra": {"requestBody": body}}
    if route == "/v1/models":
        return {"responses": {**_ok(ModelList, "the one served model"), **_errors(401)}}
    if route == "/v1/models/{model}":
        return {"responses": {**_ok(ModelCard, "the served model"), **_errors(401, 404)}}
    if route == "/health":
        return {"responses": {**_ok(Health, "the model is loaded and the server accepts requests"), **_errors()}}
    if route == "/metrics":
        return {"responses": {200: {"description": "Prometheus text format (docs/server.md, Metrics)",
                                    "content": {"text/plain": {"schema": {"type": "string"}}}}, **_errors()}}
    raise KeyError(route)


def openapi_document(app: FastAPI, api_key: bool) -> dict:
    """The OpenAPI document of `app`, with every model of MODELS under components/schemas.

    FastAPI's 422 (its own body validation) is dropped: no route lets FastAPI validate anything,
    so 422 is never answered. With `api_key`, the /v1 routes declare bearer authentication.
    """
    doc = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
    _, defs = models_json_schema([(m, "validation") for m in MODELS], ref_template=REF)
    components = doc.setdefault("components", {})
    schemas = components.setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    schemas.update(defs["$defs"])
    if api_key:
        components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    for path, item in doc["paths"].items():
        for operation in item.values():
            operation["responses"].pop("422", None)
            if api_key and path.startswith("/v1"):
                operation["security"] = [{"bearer": []}]
    return doc
