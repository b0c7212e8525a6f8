"""The transports under the server's HTTP protocol: writes coalesced per event-loop iteration, and the cycle of a
request a route answers straight from the protocol (:class:`DirectCycle`). The protocol held to the connection
limits, and the uvicorn server that runs an app over it, are :mod:`halfserve.httpserver`'s.

Writes come in bursts: uvicorn writes a response's status line and headers, then its body; the backplane answers
every request of a batch in the same iteration. Each write is a system call and, on the other end, a wake-up of the
reader. :class:`CoalescedWrites` holds a connection's writes during one iteration and sends them together at its
end, as one ``writev``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import orjson
from starlette.types import Receive, Scope
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol, RequestResponseCycle
from uvicorn.protocols.utils import get_client_addr

BODY_TIMED_OUT = "halfserve.body_timed_out"
"""Set in a request's scope when its body stalled past the body timeout (the app then sees a disconnect)."""
PROBE_PATHS = frozenset({"/health", "/ready", "/v2/health/live", "/v2/health/ready"})
"""The liveness and readiness probes: answered past the connection cap, and (:mod:`halfserve.api.http.guard`) whatever
the ``Host``."""


class CoalescedWrites:
    """A transport whose writes during one event-loop iteration go out as one; anything else goes to ``transport``."""

    def __init__(self, transport: asyncio.BaseTransport) -> None:
        self._transport: Any = transport
        self._parts: list[bytes | memoryview] = []

    def write(self, data: bytes | memoryview) -> None:
        self.writelines([data])

    def write_whole(self, data: bytes) -> None:
        """Write a whole message now (after what this iteration already holds): nothing to coalesce it with."""
        if self._parts:
            self.writelines([data])
        elif not self.is_closing():
            self._transport.write(data)

    def writelines(self, parts: list[bytes | memoryview]) -> None:
        if not self._parts:
            asyncio.get_running_loop().call_soon(self.flush)
        self._parts += parts

    def flush(self) -> None:
        if not self._parts:
            return
        parts, self._parts = self._parts, []
        if not self.is_closing():
            self._transport.writelines(parts)  # one writev under uvloop, one sendmsg under asyncio: no joined copy

    def close(self) -> None:
        self.flush()  # what was written before the close goes first, as it would have
        self._transport.close()

    def is_closing(self) -> bool:
        return bool(self._transport.is_closing())

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class ClosedByProtocol(CoalescedWrites):
    """A connection's writes, closed by its protocol (``close``, which then closes :attr:`socket`): uvicorn closes a
    connection through its transport, after an answer or once idle."""

    def __init__(self, transport: asyncio.BaseTransport, close: Callable[[], None]) -> None:
        super().__init__(transport)
        self.socket: Any = transport
        """The socket's own transport, which this one writes to and closes."""
        self.lingering = False
        """Closing: its answer is sent and its FIN, and what still arrives is read and dropped for a moment."""
        self._close = close

    def close(self) -> None:
        self._close()

    def is_closing(self) -> bool:
        return self.lingering or bool(self.socket.is_closing())


class CoalescingHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol over :class:`CoalescedWrites`: a response's head and body in one write."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(self.writes(transport))  # type: ignore[arg-type]

    def writes(self, transport: asyncio.BaseTransport) -> CoalescedWrites:
        """The connection's transport, as the protocol writes to it."""
        return CoalescedWrites(transport)


class Answer(Protocol):
    """A whole response, as a Starlette ``Response`` holds it once built."""

    status_code: int
    raw_headers: list[tuple[bytes, bytes]]
    body: bytes | memoryview


DirectHandler = Callable[[Scope, Receive], Awaitable[Answer]]
Direct = Callable[[Scope], DirectHandler | None]
"""The app's routes answered straight from the protocol: for a POST's scope (its method, path and query set), the
handler that answers it (called with that scope and the ASGI ``receive`` for its body), or None for a request the app
answers as usual."""


class DirectCycle(RequestResponseCycle):
    """uvicorn's request/response cycle for a request a :data:`Direct` handler answers: no ASGI app in between and
    no response messages, the handler's whole response written at once.

    Everything else is uvicorn's: the body arrives through ``receive`` as it would to the app (flow control, the
    body timeout and disconnects included), pipelined requests wait their turn, and the task it runs in is one of
    the server's, which a graceful shutdown waits for and, past its timeout, cancels.
    """

    async def run_asgi(self, app: Any) -> None:
        handler: DirectHandler = app
        scope: Any = self.scope
        receive: Any = self.receive
        try:
            answer = await handler(scope, receive)
        except BaseException as exc:
            self.logger.error("Exception in direct route %s", self.scope["path"], exc_info=exc)
            if not self.response_started:
                body = orjson.dumps({"error": "internal error"})
                self.keep_alive = False
                self.respond(
                    500, [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))], body
                )
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
        else:
            self.respond(answer.status_code, answer.raw_headers, answer.body)
        finally:
            self.on_response = lambda: None

    def respond(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes | memoryview) -> None:
        """Write the response (the headers carry its ``content-length``) and complete the cycle."""
        if self.disconnected or self.response_started:
            return
        self.response_started = True
        self.waiting_for_100_continue = False
        if self.access_log:
            self.access_logger.info(
                '%s - "%s %s HTTP/%s" %d',
                get_client_addr(self.scope),
                self.scope["method"],
                self.scope["path"],
                self.scope["http_version"],
                status,
            )
        content: list[bytes | memoryview] = [STATUS_LINE[status]]
        for name, value in self.default_headers:
            content += (name, b": ", value, b"\r\n")
        for name, value in headers:
            content += (name, b": ", value, b"\r\n")
        if not self.keep_alive:
            content.append(b"connection: close\r\n")
        content += (b"\r\n", body)
        writes: Any = self.transport
        if isinstance(writes, CoalescedWrites):
            writes.write_whole(b"".join(content))  # one response, one write: no need to wait for the iteration's end
        else:
            writes.write(b"".join(content))
        self.response_complete = True
        self.message_event.set()
        if not self.keep_alive:
            self.transport.close()
        self.on_response()
