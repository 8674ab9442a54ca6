"""What the HTTP server lets one client hold: request body size, time to send the headers and the
body, and open connections.

Each limit sits at the layer that sees the resource: the connection cap and the header deadline in
the HTTP protocol (a uvicorn h11 protocol subclass: before any request exists), the body size and
body deadline in an ASGI middleware (before the route reads the body). A client past a limit gets
one clear status (503, 413, 408) and its connection closed; nothing is logged per connection, so a
flood cannot flood the log. Memory held by request bodies is at most max_connections x
max_body_bytes.

A connection closed while its client is still sending a body closes *lingering*: the server
half-closes (the answer, then FIN), reads and discards what still arrives, and closes once the client
stops sending (LINGER_IDLE_S), or after LINGER_MAX_BYTES or body_timeout_s. Closed at once, the unread
bytes would make the kernel reset the connection, and a reset discards the answer before a client
that is still writing (httpx.AsyncClient) reads it.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import resource
import time
from typing import Any

from warploop.llm.openai_schema import APIError

RESERVED_FDS = 128   # files the process needs besides its connections: the model, logs, torch, sockets
LINGER_IDLE_S = 2.0          # a lingering close ends once the client has sent nothing for this long,
LINGER_MAX_BYTES = 64 << 20  # or once this much has been discarded (or after body_timeout_s)


@dataclasses.dataclass(frozen=True)
class ServerLimits:
    max_body_bytes: int = 4 << 20       # a full 128k-token prompt is well under 1 MB of JSON
    header_timeout_s: float = 10.0      # connect to the end of the request headers (also idle keep-alive)
    body_timeout_s: float = 30.0        # end of the headers to the end of the body
    max_connections: int = 512

    def __post_init__(self) -> None:
        for name, flag in (("max_body_bytes", "--max-body-bytes"), ("header_timeout_s", "--header-timeout"),
                           ("body_timeout_s", "--body-timeout"), ("max_connections", "--max-connections")):
            if not getattr(self, name) > 0:
                raise ValueError(f"{flag} must be positive, got {getattr(self, name)}")


def fit_connections_to_fd_limit(wanted: int) -> tuple[int, str | None]:
    """Raise the soft open-files limit as far as allowed; (connections that fit, a warning or None).

    Past the limit accept() fails with EMFILE and asyncio logs a traceback per attempt; a cap below
    it turns the excess into a quick 503 instead.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = min(hard, 1 << 16) if hard != resource.RLIM_INFINITY else 1 << 16
    if soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    fits = max(1, soft - RESERVED_FDS)
    if wanted <= fits:
        return wanted, None
    return fits, (f"warning: --max-connections {wanted} exceeds what the open-files limit ({soft}) allows; "
                  f"serving at most {fits} connections (raise it with ulimit -n)")


def _error(status: int, message: str, code: str) -> tuple[bytes, list[tuple[bytes, bytes]]]:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": code}}).encode()
    return body, [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                  (b"connection", b"close")]


class LimitBody:
    """ASGI middleware: a request body larger than `max_body_bytes` gets 413 (at once when its
    Content-Length says so, else when the bytes pass the limit); a body not complete within
    `body_timeout_s` of the headers gets 408. Both close the connection. Past the headers, the
    errors are raised from `receive` as APIError, so the app answers them like any other."""

    def __init__(self, app: Any, limits: ServerLimits) -> None:
        self.app, self.limits = app, limits

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limits = self.limits
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limits.max_body_bytes:
            body, headers = _error(413, _too_large(int(declared), limits), "body_too_large")
            await send({"type": "http.response.start", "status": 413, "headers": headers})
            await send({"type": "http.response.body", "body": body})
            return
        deadline = time.monotonic() + limits.body_timeout_s
        received, body_done = 0, False

        async def limited_receive() -> dict:
            nonlocal received, body_done
            if body_done:  # after the body: the disconnect, awaited for as long as the response lasts
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                raise APIError(408, f"the request body did not arrive within {limits.body_timeout_s:g} s "
                                    "(--body-timeout); send it faster", code="body_timeout", headers=CLOSE) from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limits.max_body_bytes:
                    raise APIError(413, _too_large(received, limits), code="body_too_large", headers=CLOSE)
                body_done = not message.get("more_body", False)
            return message

        await self.app(scope, limited_receive, send)


CLOSE = {"connection": "close"}   # the rest of an unread body must not be parsed as the next request


def _too_large(size: int, limits: ServerLimits) -> str:
    return (f"the request body is {size} bytes or more; this server accepts at most {limits.max_body_bytes} "
            "(--max-body-bytes)")


class _LingeringTransport:
    """A connection's transport as uvicorn sees it: its `close()` becomes the protocol's lingering
    close while the client is still sending a request body, and a plain close otherwise."""

    def __init__(self, transport: Any, protocol: Any) -> None:
        self.raw, self._protocol = transport, protocol

    def __getattr__(self, name: str) -> Any:
        return getattr(self.raw, name)

    def close(self) -> None:
        if not self._protocol.start_linger():
            self.raw.close()

    def is_closing(self) -> bool:  # lingering counts as closing: uvicorn arms no keep-alive, parses nothing more
        return self._protocol.lingering or self.raw.is_closing()


def guarded_protocol(limits: ServerLimits) -> type:
    """uvicorn's h11 protocol with a connection cap, a deadline for the request headers and a
    lingering close."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    busy_body, busy_headers = _error(503, f"the server holds its maximum of {limits.max_connections} connections "
                                          "(--max-connections); retry shortly", "too_many_connections")
    busy = (b"HTTP/1.1 503 Service Unavailable\r\n" + b"".join(k + b": " + v + b"\r\n" for k, v in busy_headers)
            + b"\r\n" + busy_body)

    class GuardedH11Protocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None
        _linger_timer: asyncio.TimerHandle | None = None
        lingering, _lost, _discarded, _linger_until = False, False, 0, 0.0

        def connection_made(self, transport: Any) -> None:
            super().connection_made(_LingeringTransport(transport, self))
            if len(self.connections) > limits.max_connections:
                transport.write(busy)
                transport.close()
                return
            self._arm_header_timer()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm_header_timer()  # the next request's headers get the same deadline

        def connection_lost(self, exc: Exception | None) -> None:
            self._lost = True
            for timer in (self._header_timer, self._linger_timer):
                if timer is not None:
                    timer.cancel()
            super().connection_lost(exc)

        def _arm_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
            self._header_timer = self.loop.call_later(limits.header_timeout_s, self._header_deadline)

        def _header_deadline(self) -> None:
            # IDLE: no complete request head since the timer was armed (nothing, or a trickle).
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()

        def start_linger(self) -> bool:
            """Begin a lingering close if the client is still sending a body; False: close at once."""
            raw = self.transport.raw
            if self.lingering or self._lost or raw.is_closing() or self.conn.their_state is not h11.SEND_BODY:
                return False
            self.lingering = True
            self._unset_keepalive_if_required()
            if self._header_timer is not None:
                self._header_timer.cancel()
            self._linger_until = self.loop.time() + limits.body_timeout_s
            if raw.can_write_eof():
                raw.write_eof()  # FIN once the answer is flushed: the client sees the response end
            raw.resume_reading()  # uvicorn may have paused reading while the body queued up
            self._arm_linger_timer()
            return True

        def data_received(self, data: bytes) -> None:
            if not self.lingering:
                super().data_received(data)
                return
            self._discarded += len(data)
            if self._discarded > LINGER_MAX_BYTES:
                self.transport.raw.close()
            else:
                self._arm_linger_timer()

        def _arm_linger_timer(self) -> None:
            if self._linger_timer is not None:
                self._linger_timer.cancel()
            wait = min(LINGER_IDLE_S, max(0.0, self._linger_until - self.loop.time()))
            self._linger_timer = self.loop.call_later(wait, self.transport.raw.close)

    return GuardedH11Protocol
