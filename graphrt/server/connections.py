"""What one client connection may do: how long it may take to send a request, how many may be
open at once, and which request heads are refused before their body is read.

uvicorn's h11 protocol alone lets a slow or silent client hold a socket forever, restarting its
only timer on every byte; `BoundedH11Protocol` gives the head and the body each a clock of its
own, and `RequestFraming` answers an oversized or ambiguously framed request from its head.
"""

from __future__ import annotations

import asyncio
import socket
from dataclasses import dataclass

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from graphrt.server.errors import APIError


@dataclass
class ConnectionLimits:
    """How long a client may take to send a request, and how many may be connected at once."""

    header_timeout_s: float = 10.0  # from connecting (or the previous response) to a whole request head
    body_timeout_s: float = 30.0  # from the head to the end of the body
    keep_alive_s: float = 5.0  # an idle keep-alive connection is closed after this
    max_connections: int = 512  # a request on a connection past this gets a 503, and the connection closes

    def __post_init__(self) -> None:
        for name in ("header_timeout_s", "body_timeout_s", "keep_alive_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {getattr(self, name)}")
        if self.max_connections < 1:
            raise ValueError(f"max_connections must be at least 1, got {self.max_connections}")


class BoundedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, bounded: a request's head must arrive within `header_timeout_s` of the
    connection opening or of the previous response, and its body within `body_timeout_s` of the
    head, however slowly the bytes trickle in (uvicorn restarts its only timer on every byte);
    a connection past `max_connections` has its request answered 503 and is closed; and responses
    leave at once (TCP_NODELAY: asyncio sets it only on sockets created with proto=IPPROTO_TCP, so
    without this Nagle holds every response after the first on a keep-alive connection ~40 ms)."""

    def __init__(self, *args, limits: ConnectionLimits, **kwargs):
        super().__init__(*args, **kwargs)
        self.limits = limits
        self.deadline: asyncio.TimerHandle | None = None
        self.deadline_phase = None  # the client's h11 state that `deadline` bounds: IDLE (the head) or SEND_BODY

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if len(self.connections) > self.limits.max_connections:
            self.limit_concurrency = 0  # uvicorn's own check then answers 503 with "Connection: close"
        self.update_deadline()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self.update_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self.update_deadline()  # the next request's head, on a kept-alive connection

    def connection_lost(self, exc: Exception | None) -> None:
        self.update_deadline(closed=True)
        super().connection_lost(exc)

    def update_deadline(self, closed: bool = False) -> None:
        """A new phase of reading a request (head, body, none) starts its own clock; bytes within a phase do not."""
        phase = None if closed or self.transport.is_closing() else self.conn.their_state
        if phase is self.deadline_phase:
            return
        if self.deadline is not None:
            self.deadline.cancel()
        timeout = {h11.IDLE: self.limits.header_timeout_s, h11.SEND_BODY: self.limits.body_timeout_s}.get(phase)
        # (no limit once the request is read: a response takes as long as it takes)
        self.deadline = self.loop.call_later(timeout, self.on_deadline) if timeout is not None else None
        self.deadline_phase = phase

    def on_deadline(self) -> None:
        # Too slow (or silent): drop it. A handler reading the body sees the client disconnect.
        if not self.transport.is_closing():
            self.transport.close()


class RequestFraming:
    """ASGI middleware refusing a request before any of its body is read when the head alone
    condemns it: a declared Content-Length over `max_body_bytes` gets its 413 at once, not after
    the upload (uvicorn then reads and drops the body, within the body timeout, so a client still
    sending sees the 413 rather than a reset connection); a request with both Content-Length and
    Transfer-Encoding gets a 400 and the connection closes (its framing is ambiguous: the
    request-smuggling pattern RFC 9112 section 6.3 lets a server reject)."""

    def __init__(self, app, max_body_bytes: int, metrics):
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.metrics = metrics

    async def __call__(self, scope, receive, send) -> None:
        error = framing_error(scope["headers"], self.max_body_bytes) if scope["type"] == "http" else None
        if error is None:
            return await self.app(scope, receive, send)
        self.metrics.count("rejected")
        response = error.response()
        if error.status == 400:
            response.headers["connection"] = "close"  # where this body ends is unknowable: no next request
        await response(scope, receive, send)


def framing_error(headers: list[tuple[bytes, bytes]], max_body_bytes: int) -> APIError | None:
    names = {name.lower() for name, _ in headers}
    if b"content-length" in names and b"transfer-encoding" in names:
        return APIError(400, "the request has both Content-Length and Transfer-Encoding; send one of them")
    declared = next((value for name, value in headers if name.lower() == b"content-length"), b"")
    if declared.isdigit() and int(declared) > max_body_bytes:
        return APIError(413, f"the request body is larger than {max_body_bytes} bytes", code="request_too_large")
    return None
