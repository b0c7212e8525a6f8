"""Transports that write once per event-loop iteration, the HTTP protocol the server runs over one, and the uvicorn
server that runs an app over it (:class:`DrainingServer`, :func:`uvicorn_config`), for the server and its front-ends.

The protocol also holds each connection to :class:`HttpLimits`: how long its request line and headers, and each gap
in its body, may take (408), how long its request target (414) and headers (431) may be, and how many connections a
process keeps open (503). uvicorn has none of these but a keep-alive timeout, so an idle or trickling connection, or
200 MiB of headers, would be held for as long as the client likes.

Writes come in bursts: uvicorn writes a response's status line and headers, then its body; the backplane answers
every request of a batch in the same iteration. Each write is a system call and, on the other end, a wake-up of the
reader. :class:`CoalescedWrites` holds a connection's writes during one iteration and sends them together at its
end, as one ``writev``.
"""

from __future__ import annotations

import asyncio
import signal
import socket
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from types import FrameType
from typing import Any, ClassVar

import orjson
import uvicorn
from starlette.types import ASGIApp
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from server.settings import Settings

LINGER_S = 2.0
"""How long a connection refused mid-head goes on being read (and dropped) before it is closed."""
BODY_TIMED_OUT = "halfserve.body_timed_out"
"""Set in a request's scope when its body stalled past the body timeout (the app then sees a disconnect)."""


class CoalescedWrites:
    """A transport whose writes during one event-loop iteration go out as one; anything else goes to ``transport``."""

    def __init__(self, transport: asyncio.BaseTransport) -> None:
        self._transport: Any = transport
        self._parts: list[bytes | memoryview] = []

    def write(self, data: bytes | memoryview) -> None:
        self.writelines([data])

    def writelines(self, parts: list[bytes | memoryview]) -> None:
        if not self._parts:
            asyncio.get_running_loop().call_soon(self.flush)
        self._parts += parts

    def flush(self) -> None:
        if not self._parts:
            return
        parts, self._parts = self._parts, []
        if not self._transport.is_closing():
            self._transport.writelines(parts)  # one writev under uvloop, one sendmsg under asyncio: no joined copy

    def close(self) -> None:
        self.flush()  # what was written before the close goes first, as it would have
        self._transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class CoalescingHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol over :class:`CoalescedWrites`: a response's head and body in one write."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(CoalescedWrites(transport))  # type: ignore[arg-type]


@dataclass(frozen=True)
class HttpLimits:
    """What one connection may take of a process (settings of the same names)."""

    header_timeout: float = 10.0
    body_timeout: float = 30.0
    max_url_bytes: int = 8192
    max_header_bytes: int = 65536
    max_connections: int = 1024


class _Refused(Exception):
    """Raised from a parser callback to stop parsing; the refusal itself is already recorded on the protocol."""


class LimitedHttpProtocol(CoalescingHttpToolsProtocol):
    """The server's HTTP protocol: coalesced writes, and every connection held to :attr:`limits`."""

    limits: ClassVar[HttpLimits] = HttpLimits()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._timer: asyncio.TimerHandle | None = None
        self._timing_head = False
        """The timer is the head's (its deadline stands however many reads the head takes)."""
        self._in_head = False
        """Inside a request's line and headers: from its first byte until its headers are complete."""
        self._in_body = False
        """Inside a request's body: from the end of its headers until the request is complete."""
        self._head_bytes = 0
        self._header_bytes = 0
        self._refused = False
        """Answered with a refusal: what still arrives is dropped."""

    @classmethod
    def with_limits(cls, limits: HttpLimits) -> type[LimitedHttpProtocol]:
        return type(cls.__name__, (cls,), {"limits": limits})

    # Connection ----------------------------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            self._refuse(503, f"server busy: {self.limits.max_connections} connections are open (max_connections)")
            return
        self._arm_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # the rest of a refused request, read only so that closing does not reset the connection
        continuing = self._in_head
        super().data_received(data)
        if continuing and self._in_head and not self._refused:
            # httptools holds a header's name and value until it ends, so the head's size is checked here too, by
            # the reads that arrived whole inside it (the read it began in, and the limit, are the most it can
            # overshoot by).
            self._head_bytes += len(data)
            limit = self.limits.max_url_bytes + self.limits.max_header_bytes
            if self._head_bytes > limit:
                what = f"request line and headers: more than {limit} bytes (max_url_bytes + max_header_bytes)"
                self._refuse(431, what, linger=True)
        # Timers are armed for a request still incomplete when a read has been parsed, not at each parser event: a
        # request that arrives whole in one read (nearly all of them) costs no timer at all.
        if self._refused:
            return
        if self._in_head:
            if not self._timing_head:
                self._arm_head()
        elif self._in_body:
            self._arm(self.limits.body_timeout, self._body_timed_out)  # bytes arrived: the gap starts again

    def send_400_response(self, msg: str) -> None:
        if not self._refused:
            super().send_400_response(msg)
        # else: a callback refused the request (and answered it); the parser error is that refusal

    # Parser callbacks ----------------------------------------------------------------------------------------------

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head, self._head_bytes, self._header_bytes = True, 0, 0

    def on_url(self, url: bytes) -> None:
        super().on_url(url)
        if len(self.url) > self.limits.max_url_bytes:
            self._refuse(414, f"request target: more than {self.limits.max_url_bytes} bytes (max_url_bytes)", True)
            raise _Refused

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_bytes += len(name) + len(value)
        if self._header_bytes > self.limits.max_header_bytes:
            self._refuse(431, f"headers: more than {self.limits.max_header_bytes} bytes (max_header_bytes)", True)
            raise _Refused
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_head, self._in_body = False, True
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._in_body = False
        self._disarm()
        super().on_message_complete()

    # Timeouts and refusals -----------------------------------------------------------------------------------------

    def _arm(self, seconds: float, then: Callable[[], None]) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self.loop.call_later(seconds, then)
        self._timing_head = False

    def _arm_head(self) -> None:
        self._arm(self.limits.header_timeout, self._head_timed_out)
        self._timing_head = True

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._timing_head = False

    def _head_timed_out(self) -> None:
        self._timer, self._timing_head = None, False
        if self.cycle is not None and not self.cycle.response_complete:
            return  # a request is being answered; the next one's head has not begun
        self._refuse(
            408, f"request line and headers not received within {self.limits.header_timeout:g} s (header_timeout)"
        )

    def _body_timed_out(self) -> None:
        self._timer = None
        cycle = self.cycle
        if cycle is None or cycle.response_complete or not cycle.more_body:
            return
        if self.flow.read_paused:  # the app is not reading yet: the wait is the server's, not the client's
            self._arm(self.limits.body_timeout, self._body_timed_out)
            return
        scope: dict[str, Any] = cycle.scope  # type: ignore[assignment]
        scope[BODY_TIMED_OUT] = True
        # The app's receive() now answers http.disconnect, so the request ends; its own answer would be lost.
        cycle.disconnected = True
        cycle.message_event.set()
        if cycle.response_started:
            self.transport.close()
        else:
            self._refuse(408, f"body: no byte received for {self.limits.body_timeout:g} s (body_timeout)")

    def _refuse(self, status: int, message: str, linger: bool = False) -> None:
        """Answer ``status`` with the API's JSON error and close the connection (``linger``: once the client has
        had a moment to stop sending)."""
        self._refused = True
        self._disarm()
        if self.transport.is_closing():
            return
        body = orjson.dumps({"error": message})
        head = (
            f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n"
        )
        if status == 503:
            head += "retry-after: 1\r\n"
        self.transport.write(head.encode("latin-1") + b"\r\n" + body)
        if linger:
            # The client may still be sending the head: closing with unread bytes would reset the connection and
            # lose the answer on its way. Send the answer and a FIN, read and drop what still comes for a moment
            # (a "lingering close", as nginx does), then close.
            writes = self.transport
            if isinstance(writes, CoalescedWrites):
                writes.flush()
            if self.transport.can_write_eof():
                self.transport.write_eof()
            self.loop.call_later(LINGER_S, self.transport.close)
        else:
            self.transport.close()
        self.logger.info("%s: %d %s", self.client or "client", status, message)


class DrainingServer(uvicorn.Server):
    """uvicorn's server, telling the app the moment a shutdown signal arrives.

    uvicorn's own sequence then runs: it stops listening, lets requests in flight finish (up to
    ``timeout_graceful_shutdown``, then cancels them), and only then runs the lifespan's shutdown, where the batchers
    drain what is still queued. The hook makes readiness answer 503 from the signal on, on connections still open.
    """

    def __init__(
        self, config: uvicorn.Config, on_signal: Callable[[], None], on_shutdown: Callable[[], None] | None = None
    ) -> None:
        super().__init__(config)
        self._on_signal = on_signal
        self._on_shutdown = on_shutdown

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self._on_signal()
        super().handle_exit(sig, frame)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's shutdown, then ``on_shutdown``; a SIGTERM that was drained is not raised again.

        uvicorn re-raises the signal it caught once it has shut down, so that the default handler ends the process:
        no ``finally`` after :meth:`run` would then run (the front-ends' temporary directory was left behind), and
        the exit status was -SIGTERM rather than the 0 a drained shutdown promises. SIGINT is still re-raised.
        """
        await super().shutdown(sockets)
        if self._on_shutdown is not None:
            self._on_shutdown()
        captured: list[int] = getattr(self, "_captured_signals", [])
        captured[:] = [sig for sig in captured if sig != signal.SIGTERM]


def http_limits(settings: Settings) -> HttpLimits:
    s = settings
    return HttpLimits(s.header_timeout, s.body_timeout, s.max_url_bytes, s.max_header_bytes, s.max_connections)


def uvicorn_config(app: ASGIApp, settings: Settings, log_config: dict[str, Any] | None, **where: Any) -> uvicorn.Config:
    """uvicorn's configuration for ``app`` under ``settings``; ``where`` is where it listens (host and port, uds),
    if not on sockets handed to ``run``."""
    return uvicorn.Config(
        app,
        **where,
        http=LimitedHttpProtocol.with_limits(http_limits(settings)),
        log_level=settings.log_level,
        log_config=log_config,
        access_log=settings.access_log,
        # uvicorn waits this long for requests in flight, then cancels them; float seconds work despite its hint.
        timeout_graceful_shutdown=settings.drain_timeout,  # type: ignore[arg-type]
    )
