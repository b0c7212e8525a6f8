"""The HTTP protocol the server and its front-ends run over coalesced writes (:mod:`halfserve.transport`); the uvicorn
server that runs an app over it is :mod:`halfserve.httpserver`'s.

The protocol also holds each connection to :class:`HttpLimits`: how long its request line and headers, and each gap
in its body, may take, and how slowly its body may arrive (408, :mod:`halfserve.httpdeadline`), how long its request
target (414) and headers (431) may be, how long its answers may wait for the client to read them (then it is
dropped), and how many connections a process keeps open (503). uvicorn has none of these but a keep-alive timeout,
so an idle or trickling connection, a client that reads no answer, or 200 MiB of headers, would be held for as long
as the client likes. A connection's
pipelined requests are read and queued :data:`MAX_PIPELINED` at most, and none while its answers wait for the client
to read them: uvicorn read and queued every one a client sent, and clients pipelining requests for large answers and
reading none grew a server by gigabytes before the send timeout dropped them. A request answered
before its body was read whole (refused from its headers) closes its connection: uvicorn would go on reading the body,
with no timer left, for as long as the client takes to send it.

Past the connection cap, a few more connections are read for a health or readiness probe (:mod:`halfserve.httpcensus`),
which is answered; any other request on them gets the 503. So a cap held by slow clients does not fail the
orchestrator's probes, and the process is not restarted or taken out of its service for what its clients do.

Bodies still arriving share a budget (:mod:`halfserve.bodybudget`), a request that cannot be parsed is answered in
JSON after the requests pipelined before it, and a connection with no request on it is closed once idle for the
keep-alive timeout, sooner in a drain (:mod:`halfserve.httpkeepalive`).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, ClassVar

import httptools
import orjson
from uvicorn.protocols.http.flow_control import HIGH_WATER_LIMIT

from halfserve.bodybudget import BodyBudget, Refusal
from halfserve.httpcensus import Census
from halfserve.httpdeadline import ReadDeadline
from halfserve.httpkeepalive import KeepAlive
from halfserve.httptarget import NoHost, absolute_form, framing_problem, is_probe, origin_path
from halfserve.settings import Settings
from halfserve.transport import (
    BODY_TIMED_OUT,
    ClosedByProtocol,
    CoalescedWrites,
    CoalescingHttpToolsProtocol,
    Direct,
    DirectCycle,
    DirectHandler,
)

LINGER_S = 2.0
"""How long a connection refused mid-head goes on being read (and dropped) before it is closed."""
MAX_PIPELINED = 16
"""Requests a connection may have queued behind the one being answered; past it the connection is not read further."""
FEED_BYTES = 4096
"""What is parsed at a time outside a request's body, so that one read of pipelined requests (uvloop reads up to
256 KiB: thousands of small requests) queues no more than :data:`MAX_PIPELINED` and a read's worth past it."""


def _default(name: str) -> Any:
    """A setting's default, written once, in :class:`~halfserve.settings.Settings`."""
    return Settings.model_fields[name].default


@dataclass(frozen=True)
class HttpLimits:
    """What one connection may take of a process: the settings of the same names, with their defaults."""

    header_timeout: float = _default("header_timeout")
    body_timeout: float = _default("body_timeout")
    max_url_bytes: int = _default("max_url_bytes")
    max_header_bytes: int = _default("max_header_bytes")
    max_connections: int = _default("max_connections")
    min_body_rate: int = _default("min_body_rate")
    http_pending_bytes: int = _default("http_pending_bytes")
    http_peer_share: float = _default("http_peer_share")
    send_timeout: float = _default("send_timeout")


class _Refused(Exception):
    """Raised from a parser callback to stop parsing; the refusal itself is already recorded on the protocol."""


class LimitedHttpProtocol(CoalescingHttpToolsProtocol):
    """The server's HTTP protocol: coalesced writes, and every connection held to :attr:`limits`."""

    limits: ClassVar[HttpLimits] = HttpLimits()
    direct: ClassVar[Direct | None] = None
    """The app's routes answered without going through the ASGI app (:class:`DirectCycle`)."""
    census: ClassVar[Census] = Census(HttpLimits.max_connections)
    """The server's connections (one per :meth:`with_limits` class, so one per server)."""
    budget: ClassVar[BodyBudget] = BodyBudget.of(HttpLimits.http_pending_bytes, HttpLimits.http_peer_share)
    """The bytes of the server's bodies still arriving (one per :meth:`with_limits` class)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        limits = self.limits
        self._deadline = ReadDeadline(
            self.loop,
            limits.header_timeout,
            limits.body_timeout,
            limits.min_body_rate,
            self._head_timed_out,
            self._body_timed_out,
        )
        self._in_head = False
        """Inside a request's line and headers: from its first byte until its headers are complete."""
        self._in_body = False
        """Inside a request's body: from the end of its headers until the request is complete."""
        self._head_bytes = 0
        self._header_bytes = 0
        self._refused = False
        """Answered before its request was read whole (a refusal, or the app's answer while the body was still
        arriving), and closing: what still arrives is dropped."""
        self._keep_alive_after_body = False
        """Whether the connection stays open after its request's answer, once the body is read (until then it
        cannot: see :meth:`_close_after_early_answer`)."""
        self._out: ClosedByProtocol
        """The connection's transport (``self.transport``, as uvicorn types it)."""
        self._send_timer: asyncio.TimerHandle | None = None
        """Armed while what the connection has to send waits for the client to read it (``send_timeout``)."""
        self._keep_alive = KeepAlive(self.loop, self.timeout_keep_alive, self.timeout_keep_alive_handler)
        self._standby = False
        """Past the connection cap: only a probe is answered, then the connection is closed."""
        self._unparsed = b""
        """Bytes read but not parsed yet: the connection's pipelined requests past what it may queue (``_held``)."""
        self._next_due = False
        """A request was answered and the next queued one is still to be started (:meth:`_start_pipelined`)."""
        self._malformed: str | None = None
        """The 400 owed to a request that could not be parsed, sent once the requests before it are answered."""
        self.peer = ""
        """The client's address, whose bodies share the budget's ``http_peer_share`` (:class:`BodyBudget`)."""
        self.pending, self.arriving_since = 0, 0.0
        """Bytes of the arriving body the budget counts, and since when."""

    @classmethod
    def with_limits(cls, limits: HttpLimits, direct: Direct | None = None) -> type[LimitedHttpProtocol]:
        # A staticmethod: a function stored on the class is not bound to the protocol instance.
        attributes = {
            "limits": limits,
            "direct": None if direct is None else staticmethod(direct),
            "census": Census(limits.max_connections),
            "budget": BodyBudget.of(limits.http_pending_bytes, limits.http_peer_share),
        }
        return type(cls.__name__, (cls,), attributes)

    # Connection ----------------------------------------------------------------------------------------------------

    def writes(self, transport: asyncio.BaseTransport) -> CoalescedWrites:
        self._out = ClosedByProtocol(transport, self.close_connection)
        return self._out

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self.peer = self.client[0] if self.client else ""
        place = self.census.admit(self)
        if place is None:  # every place past the cap answers a probe (for a moment): this connection gets the 503
            self.refuse_busy()
            return
        self._standby = not place
        self._deadline.head()

    def refuse_busy(self) -> None:
        """The connection cap's 503, after which the client may still be sending its request: a lingering close, so
        that the answer is read rather than lost to a reset."""
        self._refuse(503, f"server busy: {self.limits.max_connections} connections are open (max_connections)", True)

    def connection_lost(self, exc: Exception | None) -> None:
        self.budget.release(self)
        self.census.leave(self)
        self._deadline.stop()
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None
        self._unparsed = b""
        super().connection_lost(exc)
        self._keep_alive.stop()

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # the rest of a refused request, read only so that closing does not reset the connection
        self._unparsed += data
        self._parse_unparsed()

    def _held(self) -> bool:
        """Whether the connection's next requests wait unparsed: it has as many queued as it may, or (outside a
        body, which its request's app may be waiting for) its answers wait for the client to read them."""
        return len(self.pipeline) >= MAX_PIPELINED or (self.flow.write_paused and not self._in_body)

    def _parse_unparsed(self) -> None:
        """Parse what was read, until the connection is held (then it is not read further either)."""
        while self._unparsed and not self._refused:
            if self._held():
                self.flow.pause_reading()
                return
            size = len(self._unparsed) if self._in_body else FEED_BYTES
            data, self._unparsed = self._unparsed[:size], self._unparsed[size:]
            self._parse(data)
        if self._refused:
            self._unparsed = b""

    def _resume(self) -> None:
        """The connection may no longer be held: parse what waits, then read on (unless the app has yet to take the
        body it holds, which it resumes reading for itself)."""
        if self._out.is_closing():
            return
        self._parse_unparsed()
        body_waits = (
            self.cycle is not None and not self.cycle.response_complete and len(self.cycle.body) > HIGH_WATER_LIMIT
        )
        if not self._unparsed and not self._held() and not body_waits:
            self.flow.resume_reading()

    def _parse(self, data: bytes) -> None:
        continuing = self._in_head
        self._unset_keepalive_if_required()
        try:  # uvicorn's data_received, without its warning for every refusal a callback raised
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            pass  # no route upgrades: what follows the head is dropped, and the connection closes after its answer
        except httptools.HttpParserError as e:
            self.send_400_response(str(e))
        if continuing and self._in_head and not self._refused:
            # httptools holds a header's name and value until it ends, so the head's size is checked here too, by
            # the reads that arrived whole inside it (the read it began in, and the limit, are the most it can
            # overshoot by).
            self._head_bytes += len(data)
            limit = self.limits.max_url_bytes + self.limits.max_header_bytes
            if self._head_bytes > limit:
                what = f"request line and headers: more than {limit} bytes (max_url_bytes + max_header_bytes)"
                self._refuse(431, what, linger=True)
        # The deadline is armed for a request still incomplete once a read is parsed, not at each parser event.
        if self._refused:
            return
        if self._in_head:
            if not self._deadline.timing_head:
                self._deadline.head()
        elif self._in_body:
            self._deadline.body()

    def send_400_response(self, msg: str) -> None:
        """A request httptools cannot parse: a 400 in JSON naming what is wrong, once the requests pipelined before it
        are answered (not lost to it), then the connection is closed. A request in progress whose body it is ends."""
        if self._refused:
            return  # a callback refused the request (and answered it); the parser error is that refusal
        message = f"request: not valid HTTP/1.1 ({msg})"  # httptools' words name the problem
        cycle = self.cycle
        # Its body is what is malformed, its head read behind a request in progress: it never starts.
        queued = next((entry for entry in self.pipeline if entry[0] is cycle), None) if self._in_body else None
        if queued is not None:
            self.pipeline.remove(queued)
            idle = not self.pipeline and self._next_due  # the one before it is answered, and none is to start
        elif self._in_body and cycle is not None and not cycle.response_complete:
            self.give_up(message, 400)  # the request in progress
            return
        else:
            idle = (cycle is None or cycle.response_complete) and not self.pipeline
        if idle:
            self._refuse(400, message, linger=True)
        else:
            self._malformed, self._refused = message, True  # nothing after it is read; on_response_complete answers

    # Between requests ----------------------------------------------------------------------------------------------

    def on_response_complete(self) -> None:
        """uvicorn's: count the request, start a pipelined one or wait idle for the next; without a timer each."""
        self.server_state.total_requests += 1
        if self.transport.is_closing():
            return
        if self._malformed is not None and not self.pipeline:
            self._refuse(400, self._malformed, linger=True)
            return
        if self.pipeline:
            # Once this iteration's writes are sent: the next request is not started while they wait to be read.
            self._next_due = True
            self.loop.call_soon(self._start_pipelined)
            return
        self._keep_alive.idle()
        self._resume()  # after: a request it parses marks the connection busy again

    def _start_pipelined(self) -> None:
        """Start the next queued request, unless the answers before it wait for the client (then
        :meth:`resume_writing` does, once they are read)."""
        if not self._next_due or self._out.is_closing() or self.flow.write_paused or not self.pipeline:
            return
        self._next_due = False
        cycle, app = self.pipeline.pop()
        self._start_asgi_task(cycle, app)
        self._resume()

    def shutdown(self) -> None:
        """A drain (uvicorn calls it on every connection): the request in progress, or else the next one to arrive
        within :data:`~halfserve.httpkeepalive.DRAIN_IDLE_S` of the last answer, is answered with ``connection:
        close``, and the connection closes after it; one idle that long already closes now. Requests pipelined behind
        the last one answered are dropped unanswered, as uvicorn drops them (its ``connection: close`` tells the
        client)."""
        self._keep_alive_after_body = False  # nor once its body is read
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.keep_alive = False
        self._keep_alive.drain()  # an idle one closes now, or once idle for DRAIN_IDLE_S
        # Otherwise a request's head or a pipelined one is arriving: on_headers_complete makes its answer the last.

    def _unset_keepalive_if_required(self) -> None:
        self._keep_alive.busy()

    # Parser callbacks ----------------------------------------------------------------------------------------------

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head, self._head_bytes, self._header_bytes = True, 0, 0
        self._keep_alive_after_body = False

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
        self._host_from_target()
        if (problem := framing_problem(self.headers, bool(self.parser.should_upgrade()))) is not None:
            self._refuse(*problem, linger=True)
            raise _Refused
        if self.expect_100_continue and (refusal := self._refusal_before_body()) is not None:
            self._refuse(refusal.status, refusal.message, linger=True)  # not told to go on: it sends no body
            raise _Refused
        if self._standby:
            if not is_probe(self.parser.get_method(), self.url):
                self.refuse_busy()
                raise _Refused
            super().on_headers_complete()
            self.cycle.keep_alive = False  # its place is for the next probe
            return
        handler = self._direct_handler()
        if handler is None:
            before = self.cycle
            super().on_headers_complete()
            if self.cycle is not before:  # not a WebSocket upgrade (none is served)
                self._close_after_early_answer()
                self._keep_alive_after_body &= not self.parser.should_upgrade()  # what followed its head was dropped
            return
        # What uvicorn's on_headers_complete does for a plain request on an idle connection, with a DirectCycle.
        scope: Any = self.scope
        http_version = self.parser.get_http_version()
        if http_version != "1.1":
            scope["http_version"] = http_version
        self.cycle = DirectCycle(
            scope=scope,
            transport=self.transport,
            flow=self.flow,
            logger=self.logger,
            access_logger=self.access_logger,
            access_log=self.access_log,
            default_headers=self.server_state.default_headers,
            message_event=asyncio.Event(),
            expect_100_continue=self.expect_100_continue,
            keep_alive=http_version != "1.0" and self.parser.should_keep_alive(),
            on_response=self.on_response_complete,
        )
        self._close_after_early_answer()
        self._start_asgi_task(self.cycle, handler)  # type: ignore[arg-type]

    def _host_from_target(self) -> None:
        """An absolute-form target's host in place of every ``Host`` the request sent (:func:`absolute_form`): the
        Host check then judges the name the request is for, and answers one the URL parser would refuse in JSON."""
        try:
            found = absolute_form(self.url)
        except NoHost as e:
            self._refuse(400, str(e))
            raise _Refused from None
        if found is not None:
            authority, self.url = found
            self.headers[:] = [(name, value) for name, value in self.headers if name != b"host"]
            self.headers.append((b"host", authority))

    def _refusal_before_body(self) -> Refusal | None:
        """A request waiting for ``100 Continue`` is refused from its ``Content-Length`` where the budget has no room
        for its body (:meth:`BodyBudget.ask`), rather than asked for the body and refused once it arrives."""
        length = next((value for name, value in self.headers if name == b"content-length"), b"")
        if not self.peer or not length.isdigit():
            return None  # the relay's (counted by its front-end), or a chunked body, counted as it arrives
        return self.budget.ask(self, int(length), self.loop.time())

    def _close_after_early_answer(self) -> None:
        """An answer sent before the request's body is read whole closes the connection (``connection: close``,
        then a lingering close): the rest of the body would otherwise have to be read, for as long as the client
        takes, before the next request could begin. Until its body is whole, the request's cycle is told the
        connection is not kept; :meth:`on_message_complete` tells it what the request asked for."""
        self._keep_alive_after_body, self.cycle.keep_alive = (
            self.cycle.keep_alive and not self._keep_alive.draining,
            False,
        )

    def _direct_handler(self) -> DirectHandler | None:
        """The :attr:`direct` handler for the request whose headers just ended, with its scope's method and path set;
        None for one uvicorn starts as usual (not a direct route, an upgrade, a connection still answering the
        request before, or a server refusing past its concurrency limit)."""
        direct = type(self).direct
        if direct is None or self.parser.get_method() != b"POST" or self.parser.should_upgrade():
            return None
        if self.limit_concurrency is not None or (self.cycle is not None and not self.cycle.response_complete):
            return None
        if (target := origin_path(self.url)) is None:
            return None
        path, raw_path, query = target
        scope: Any = self.scope  # as uvicorn sets it (and sets it again for a request that is not direct)
        scope["method"] = "POST"
        scope["path"] = self.root_path + path
        scope["raw_path"] = self.root_path.encode("ascii") + raw_path
        scope["query_string"] = query
        return direct(scope)

    def on_body(self, body: bytes) -> None:
        self._deadline.body_bytes += len(body)
        # Counted where a client sent it; a socket with no address is the front-ends' relay, which counted it.
        if self.peer and (refusal := self.budget.claim(self, len(body), self.loop.time())) is not None:
            self.give_up(refusal.message, refusal.status)
            raise _Refused
        super().on_body(body)

    def paused(self) -> bool:
        return bool(self.flow.read_paused)

    def give_up(self, why: str, status: int = 503, linger: bool = True) -> None:
        """The body may not go on arriving (its bytes went to another, or it is too slow): the request ends, answered
        ``status``, and the connection is closed (``linger``: once the client has stopped sending)."""
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True  # the app's receive() now answers http.disconnect; its own answer is lost
            cycle.message_event.set()
            if cycle.response_started:
                self.transport.close()
                return
        self._refuse(status, why, linger)

    def on_message_complete(self) -> None:
        self.budget.release(self)
        self._in_body = False
        self._deadline.body_ended()
        if self.cycle is not None and not self.cycle.response_started:
            self.cycle.keep_alive = self._keep_alive_after_body
        super().on_message_complete()

    # Timeouts and refusals -----------------------------------------------------------------------------------------

    def _head_timed_out(self) -> None:
        if self.cycle is not None and not self.cycle.response_complete:
            return  # a request is being answered; the next one's head has not begun
        if self._unparsed:
            return  # the next head has arrived and waits for the client to read the answers before it
        if self._standby:
            self.refuse_busy()
            return
        self._refuse(
            408, f"request line and headers not received within {self.limits.header_timeout:g} s (header_timeout)"
        )

    def _body_timed_out(self) -> None:
        cycle = self.cycle
        if cycle is None or cycle.response_complete or not cycle.more_body:
            return
        if self.flow.read_paused:  # the app is not reading yet: the wait is the server's, not the client's
            self._deadline.server_waits()
            return
        scope: dict[str, Any] = cycle.scope  # type: ignore[assignment]
        scope[BODY_TIMED_OUT] = True
        why, still_sending = self._deadline.body_refusal()
        self.give_up(why, 408, still_sending)  # one still sending must not lose its answer to a reset

    def _refuse(self, status: int, message: str, linger: bool = False) -> None:
        """Answer ``status`` with the API's JSON error and close the connection (``linger``: once the client has
        had a moment to stop sending)."""
        self._refused = True
        self.budget.release(self)
        if self._standby:
            self.census.leave(self)  # its place is free for a probe, while it closes
        self._deadline.stop()
        if self.transport.is_closing():
            return
        body = orjson.dumps({"error": message})
        head = (
            f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n"
        )
        if status in (429, 503):
            head += "retry-after: 1\r\n"
        default = b"".join(b"%s: %s\r\n" % header for header in self.server_state.default_headers)  # date, server
        self.transport.write(head.encode("latin-1") + default + b"\r\n" + body)
        if linger:
            self._linger()  # the client may still be sending its request
        else:
            self._close_now()
        self.logger.info("%s: %d %s", self.client or "client", status, message)

    # Closing -------------------------------------------------------------------------------------------------------

    def close_connection(self) -> None:
        """Close the connection after what was written (every close comes here, uvicorn's through the transport):
        at once, or lingering while its request's body is still arriving."""
        if self._out.is_closing():
            return
        if self._in_body:
            self._refused = True  # answered early (uvicorn wrote connection: close): the rest is dropped
            self._linger()
        else:
            self._close_now()

    def _linger(self) -> None:
        """Closing with unread bytes would reset the connection and lose the answer on its way: send the answer and
        a FIN, read and drop what still comes for ``LINGER_S`` (a "lingering close", as nginx does), then close."""
        self._deadline.stop()
        out = self._out
        out.flush()
        if out.socket.can_write_eof():
            out.socket.write_eof()
        out.lingering = True
        self.flow.resume_reading()  # a body the app had not read yet may have paused it
        self.loop.call_later(LINGER_S, self._close_now)

    def _close_now(self) -> None:
        """Close the socket once what was written is sent, or drop it if that is still unsent after
        ``send_timeout``: a close waits for the client to read, and one that never does would hold the socket."""
        out = self._out
        out.flush()
        if out.socket.is_closing():
            return
        out.socket.close()
        if out.socket.get_write_buffer_size():
            self._arm_send()

    # Sending -------------------------------------------------------------------------------------------------------
    # The transport pauses the protocol when its buffer is past its high-water mark (the socket's own buffers are
    # full: the client is not reading) and resumes it once the buffer drains. A response waits for that, as does
    # every pipelined request behind it; a client that never reads would hold the connection for ever.

    def pause_writing(self) -> None:
        super().pause_writing()
        self._arm_send()
        if self._held():
            self.flow.pause_reading()  # its next requests would only add answers to wait

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._send_timer is not None and not self._out.socket.is_closing():  # a closing one must drain whole
            self._send_timer.cancel()
            self._send_timer = None
        self._start_pipelined()
        self._resume()

    def _arm_send(self) -> None:
        if self._send_timer is None:
            self._send_timer = self.loop.call_later(self.limits.send_timeout, self._send_timed_out)

    def _send_timed_out(self) -> None:
        self._send_timer = None
        unsent = self._out.socket.get_write_buffer_size()
        what = f"{unsent} bytes of answers not read by the client within {self.limits.send_timeout:g} s (send_timeout)"
        self.logger.info("%s: %s: connection dropped", self.client or "client", what)
        self._out.socket.abort()
