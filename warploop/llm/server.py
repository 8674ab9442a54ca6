"""The OpenAI-compatible HTTP API over one Engine: /v1/completions, /v1/chat/completions (SSE
streaming or not), /v1/models, /health and Prometheus /metrics.

The engine generates on its own thread and reports each token through a callback on that thread.
`_EngineRequest` hands those events to the event loop with `call_soon_threadsafe`, so each request's
queue is only ever touched by the loop. Whoever consumes a request's events aborts it in a `finally`
unless it finished: a client that disconnects (mid-stream, or while waiting for a non-streamed
answer) thereby frees its KV blocks at once. Admission is the engine's: when the KV pool is full,
requests wait in its queue rather than fail.

What one client may hold (body size, header and body time, connections) is bounded by
warploop.llm.server_limits; turning a body into prompt ids runs off the loop (server_prepare).
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from warploop.llm.openai_schema import APIError, ChatCompletionRequest, CompletionRequest
from warploop.llm.server_limits import LimitBody, ServerLimits
from warploop.llm.server_metrics import CountRequests, ServerMetrics
from warploop.llm.server_openapi import openapi_document, route_docs
from warploop.llm.server_prepare import RequestPreparer
from warploop.llm.server_watchdog import DEFAULT_ENGINE_TIMEOUT_S, EngineWatchdog, failure_event, is_device_fault

# OpenAI's default output budget for /v1/completions; chat defaults to whatever the context leaves.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


class _EngineRequest:
    """One engine request as seen from asyncio: `events()` yields its StreamEvents in order, and
    `close()` (idempotent) aborts it unless it finished and records its metrics."""

    def __init__(self, engine: Any, prompt_ids: list[int], params: Any, metrics: ServerMetrics,
                 watchdog: EngineWatchdog) -> None:
        self._engine, self._metrics, self._watchdog = engine, metrics, watchdog
        self._prompt_tokens = len(prompt_ids)
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue = asyncio.Queue()
        self._arrival = time.perf_counter()
        self._ttft: float | None = None
        self._tokens = 0
        self._closed = False
        self.finish_reason: str | None = None
        self.request_id = engine.add_request(prompt_ids, params, self._on_event)
        watchdog.jobs.add(self)

    def _on_event(self, event: Any) -> None:  # runs on the engine thread
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, event)
            if event.error and is_device_fault(event.error):
                self._loop.call_soon_threadsafe(self._watchdog.stall, f"the device failed: {event.error}")
        except RuntimeError:
            pass  # the loop has closed (shutdown): nobody is waiting for this request any more

    def fail(self, message: str) -> None:
        """End this request with an error event now (the engine is stuck: its own events may never come)."""
        self._queue.put_nowait(failure_event(self.request_id, self._prompt_tokens, self._tokens, message))

    async def events(self) -> AsyncIterator[Any]:
        while self.finish_reason is None:
            event = await self._queue.get()
            if self._ttft is None:
                self._ttft = time.perf_counter() - self._arrival
            self._tokens = event.completion_tokens
            self.finish_reason = event.finish_reason
            yield event

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._watchdog.jobs.discard(self)
        if self.finish_reason is None:
            self._engine.abort(self.request_id)
        self._metrics.request_done(self.finish_reason or "abort", self._ttft,
                                   time.perf_counter() - self._arrival, self._tokens)


class _EngineStream(StreamingResponse):
    """An SSE response that closes its engine request however the response ends: finished,
    client gone (Starlette cancels the body), or cancelled before the first byte was sent."""

    def __init__(self, job: _EngineRequest, body: AsyncIterator[str]) -> None:
        super().__init__(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.job = job

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.job.close()


async def _until_disconnect(request: Request) -> None:
    # The body has been read, so the next ASGI message is the disconnect (or the end of the response).
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _usage(event: Any) -> dict[str, int]:
    return {"prompt_tokens": event.prompt_tokens, "completion_tokens": event.completion_tokens,
            "total_tokens": event.prompt_tokens + event.completion_tokens}


def _sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


def _engine_failure(event: Any) -> APIError:
    """The error for a request the engine ended with "abort" although its client is still there."""
    if event.error:
        return APIError(500, f"the engine failed this request: {event.error}", type="server_error")
    return APIError(503, "the engine aborted the request (the server is shutting down); retry",
                    type="server_error", code="aborted")


class _Reply:
    """Response bodies of one request, in the shape of the endpoint it came to."""

    def __init__(self, chat: bool, model: str) -> None:
        self.chat = chat
        self.head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", "created": int(time.time()),
                     "model": model}

    def full(self, text: str, last: Any) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}}
        else:
            choice = {"index": 0, "text": text}
        choice.update(logprobs=None, finish_reason=last.finish_reason)
        return {**self.head, "object": "chat.completion" if self.chat else "text_completion",
                "choices": [choice], "usage": _usage(last)}

    def chunk(self, text: str | None, finish_reason: str | None, role: bool = False) -> dict:
        if self.chat:
            delta = ({"role": "assistant"} if role else {}) | ({"content": text} if text is not None else {})
            choice = {"index": 0, "delta": delta}
        else:
            choice = {"index": 0, "text": text or ""}
        choice.update(logprobs=None, finish_reason=finish_reason)
        return {**self.head, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "choices": [choice]}

    def usage_chunk(self, last: Any) -> dict:
        return {**self.chunk(None, None), "choices": [], "usage": _usage(last)}


async def _stream(job: _EngineRequest, reply: _Reply, include_usage: bool) -> AsyncIterator[str]:
    if reply.chat:
        yield _sse(reply.chunk("", None, role=True))
    last = None
    async for event in job.events():
        last = event
        if event.finish_reason == "abort":
            yield _sse(_engine_failure(event).body())
            return
        if event.text_delta or event.finish_reason:
            yield _sse(reply.chunk(event.text_delta, event.finish_reason))
    if include_usage:
        yield _sse(reply.usage_chunk(last))
    yield _sse("[DONE]")


async def _collect(job: _EngineRequest) -> tuple[str, Any]:
    parts, last = [], None
    async for event in job.events():
        parts.append(event.text_delta)
        last = event
    return "".join(parts), last


def create_app(engine: Any, api_key: str | None = None, limits: ServerLimits | None = None,
               engine_timeout_s: float = DEFAULT_ENGINE_TIMEOUT_S,
               on_fatal: Callable[[str], None] | None = None) -> FastAPI:
    """The FastAPI app serving `engine`. The caller owns the engine (and closes it after serving).

    A device fault, or an engine that produces no token for `engine_timeout_s` while requests run,
    fails every open request with an error naming it, turns /health and new requests into 503, and
    calls `on_fatal(message)` (server_watchdog.py); `warploop serve` then exits.

    With `api_key`, every /v1 route and /openapi.json require `Authorization: Bearer <api_key>`
    (/docs and /redoc, which a browser loads without the header, are off); /health and /metrics
    stay open for load balancers and scrapers. `limits` bound request bodies (ServerLimits()).
    """
    metrics = ServerMetrics(engine)
    watchdog = EngineWatchdog(engine, engine_timeout_s, on_fatal or (lambda message: None))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        task = asyncio.ensure_future(watchdog.run())
        try:
            yield
        finally:
            task.cancel()

    started = int(time.time())
    docs = {} if api_key is None else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    # No redirect from a path with a trailing slash: an API answers 404 in its error shape, not 307.
    app = FastAPI(title="warploop", summary="OpenAI-compatible API for the warploop engine", redirect_slashes=False,
                  lifespan=lifespan, **docs)

    def openapi() -> dict:  # the document is built once, on first use, from route_docs and the models
        if app.openapi_schema is None:
            app.openapi_schema = openapi_document(app, api_key is not None)
        return app.openapi_schema

    app.openapi = openapi
    app.add_middleware(LimitBody, limits=limits or ServerLimits())
    app.add_middleware(CountRequests, metrics=metrics)  # added last: outermost, so it counts 413s too

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = {404: f"no route {request.url.path}; the API lives under /v1",
                   405: f"{request.method} is not allowed on {request.url.path}"}.get(exc.status_code, exc.detail)
        return JSONResponse(APIError(exc.status_code, str(message)).body(), status_code=exc.status_code,
                            headers=exc.headers)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        body = APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error").body()
        return JSONResponse(body, status_code=500)

    def authorize(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise APIError(401, "missing API key: send the header 'Authorization: Bearer <key>' with the key "
                                "the server was started with (--api-key)", code="invalid_api_key")
        if not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise APIError(401, "incorrect API key: use the key the server was started with (--api-key)",
                           code="invalid_api_key")

    def check_model(model: str | None) -> None:
        if model is not None and model != engine.model_name:
            raise APIError(404, f"the model {model!r} does not exist; this server serves {engine.model_name!r} "
                                "(see /v1/models)", param="model", code="model_not_found")

    def model_card() -> dict:
        return {"id": engine.model_name, "object": "model", "created": started, "owned_by": "warploop",
                "max_model_len": engine.max_context}

    if api_key is not None:
        @app.get("/openapi.json", include_in_schema=False)
        async def openapi_with_key(request: Request) -> dict:
            authorize(request)
            return app.openapi()

    def refuse_if_stalled() -> None:
        if watchdog.stalled:
            raise APIError(503, f"{watchdog.stalled}; the server is stopping", type="server_error",
                           code="engine_failed")

    @app.get("/health", **route_docs("/health"))
    async def health() -> dict:
        refuse_if_stalled()
        return {"status": "ok", "model": engine.model_name}

    @app.get("/metrics", response_class=PlainTextResponse, **route_docs("/metrics"))
    async def prometheus_metrics() -> Response:
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    @app.get("/v1/models", **route_docs("/v1/models"))
    async def list_models(request: Request) -> dict:
        authorize(request)
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model}", **route_docs("/v1/models/{model}"))
    async def get_model(request: Request, model: str) -> dict:
        authorize(request)
        check_model(model)
        return model_card()

    preparer = RequestPreparer(engine, check_model, COMPLETIONS_DEFAULT_MAX_TOKENS)

    async def generate(request: Request, schema: type) -> Response:
        authorize(request)
        refuse_if_stalled()
        prepared = await preparer(await request.body(), schema)
        body, chat = prepared.body, schema is ChatCompletionRequest
        try:
            job = _EngineRequest(engine, prepared.prompt_ids, prepared.params, metrics, watchdog)
        except ValueError as exc:  # the engine's own checks: token ids, context, stop strings
            raise APIError(400, str(exc)) from None
        except RuntimeError as exc:  # the engine is closed: shutting down
            raise APIError(503, str(exc), type="server_error") from None
        reply = _Reply(chat, engine.model_name)
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return _EngineStream(job, _stream(job, reply, include_usage))
        work = asyncio.ensure_future(_collect(job))
        gone = asyncio.ensure_future(_until_disconnect(request))
        try:
            done, _ = await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            work.cancel()  # no-op when done; otherwise the client left and nobody will read the answer
            job.close()
        if work not in done:
            return Response(status_code=499)  # nginx's "client closed request"; nobody receives it
        text, last = work.result()
        if last.finish_reason == "abort":
            raise _engine_failure(last)
        return JSONResponse(reply.full(text, last))

    @app.post("/v1/completions", **route_docs("/v1/completions"))
    async def completions(request: Request) -> Response:
        return await generate(request, CompletionRequest)

    @app.post("/v1/chat/completions", **route_docs("/v1/chat/completions"))
    async def chat_completions(request: Request) -> Response:
        return await generate(request, ChatCompletionRequest)

    return app
