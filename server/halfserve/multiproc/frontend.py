"""An HTTP front-end process (``--http-workers N``): the inference routes answered here, the rest relayed.

The front-end runs the same inference endpoints as a single-process server (the same decoding, validation, errors and
encoding, through :func:`halfserve.api.http.answer_first`), but a model's
:meth:`~halfserve.multiproc.client.RemoteModel.submit` hands the decoded inputs to the engine process over the backplane
(:mod:`halfserve.multiproc.client`) instead of to a local batcher. Every other request (health, readiness, listings,
model metadata, statistics, metrics, management, the status page) is relayed unchanged to the engine process's own HTTP
server on a Unix socket, so there is one source of truth for the models' state.

A front-end lives no longer than its connection to the engine process: when it is lost while the front-end is not
draining (the engine process was killed: the kernel closed its end), the front-end drains and exits, so that no
process outlives the engine process holding the port. If the engine process still runs, its supervisor starts a new
front-end in its place."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import select
import shutil
import signal
import socket
import sys
import time
from collections.abc import Callable

import httpx
from starlette.datastructures import State
from starlette.types import Receive, Scope, Send

from halfserve import collector, logs
from halfserve.api.http import (
    MANAGEMENT_BODY_BYTES,
    MANAGEMENT_LIMIT,
    RELAYED_CLIENT,
    REQUEST_ID_HEADER,
    ROUTE_ONLY,
    answer_first,
    direct_routes,
    error_response,
    head_as_get,
    scope_header,
    scope_request_id,
    too_large_message,
)
from halfserve.httpserver import DrainingServer, uvicorn_config
from halfserve.multiproc.client import BackplaneClient, RemoteMetrics, RemoteService
from halfserve.regions import Regions
from halfserve.serving import AppState
from halfserve.settings import Settings
from halfserve.transport import PROBE_PATHS

log = logging.getLogger(__name__)

RECORD_FLUSH_S = 0.1
"""How often a front-end sends its request counts to the engine process (and so how stale ``/metrics`` may be)."""
PUBLISH_WAIT_S = 10.0
"""Longest a relayed change waits for every front-end to have it before it is answered anyway (the engine process
itself gives up after :data:`~halfserve.multiproc.engine_side.PUBLISH_TIMEOUT_S`)."""
HOP_BY_HOP = {b"connection", b"keep-alive", b"transfer-encoding", b"content-length", b"upgrade", b"te", b"trailer"}
"""Headers that describe one connection, not the message: the relay sets its own."""
FRONTEND_SETS = {b"date", b"server"}
"""Headers the front-end's own HTTP server adds to every answer: the engine process's copies would repeat them."""
ORPHANED_WAIT_S = 2.0
"""How long a front-end whose connection was lost looks for itself handed to another parent before it says the engine
process still runs: the kernel closes a killed process's sockets before it re-parents its children."""


def _pidfd(pid: int) -> int | None:
    """A pidfd of ``pid`` (Linux 5.3 and newer), or None where there is none to be had."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):  # an older kernel or another platform; the process gone already
        return None


class FrontendApp:
    """The front-end's ASGI app: inference routes here, everything else relayed to the engine process."""

    def __init__(
        self, settings: Settings, api_socket: str, backplane_socket: str, secret: str, index: int, engine_pid: int
    ) -> None:
        self.settings = settings
        self.api_socket = api_socket
        self.backplane_socket = backplane_socket
        self.secret = secret
        self.index = index
        self.engine_pid = engine_pid
        """The engine process, which spawned this one: while it runs, it is this process's parent."""
        self._engine_fd = _pidfd(engine_pid)
        """A descriptor that polls readable once the engine process has exited (Linux's pidfd), or None."""
        self.exit: Callable[[], None] | None = None
        """Stops this front-end's HTTP server (a drain, as on SIGTERM): called once its engine connection is lost."""
        self.engine_lost = False
        """Whether this front-end stops because its connection to the engine process was lost."""
        self._closing = False
        self._leaving: asyncio.Task[None] | None = None
        self.service = RemoteService(settings)
        self.regions = Regions(settings.max_shm_regions)
        """The engine process's shared memory regions, mapped here too: this process decodes and encodes."""
        self.serving = AppState(settings, self.service, self.regions)
        self.state = State({"serving": self.serving})
        self.http: httpx.AsyncClient | None = None
        self.probes: httpx.AsyncClient | None = None
        """Relays the health and readiness probes on connections of their own: whatever holds the other relayed
        routes' connections (clients slow to read an answer, a burst of listings) never makes a probe wait."""
        self.client: BackplaneClient | None = None
        self._flusher: asyncio.Task[None] | None = None

    def begin_drain(self) -> None:
        self.serving.draining = True

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        scope = head_as_get(scope)
        if not await answer_first(self, scope, receive, send):
            await self._relay(scope, receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self._start()
                except Exception as e:
                    log.exception("front-end %d could not start", self.index)
                    await send({"type": "lifespan.startup.failed", "message": str(e)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self._stop()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _start(self) -> None:
        self.client = BackplaneClient(self.service.update, self.regions.sync, self._lost)
        self.service.client = self.client
        self.serving.metrics = RemoteMetrics(self.client)
        await self.client.connect(self.backplane_socket, self.index, self.secret)
        self.http, self.probes = (
            httpx.AsyncClient(
                transport=httpx.AsyncHTTPTransport(uds=self.api_socket), base_url="http://halfserve", timeout=None
            )
            for _ in range(2)
        )
        self._flusher = asyncio.create_task(self._flush_records(), name="flush-records")
        collector.settle()

    async def _flush_records(self) -> None:
        assert self.client is not None
        while True:
            await asyncio.sleep(RECORD_FLUSH_S)
            self.client.flush()

    def _lost(self) -> None:
        """The connection to the engine process is lost: unless this front-end closed it (it is stopping), every
        inference request from now on would fail, and the port would stay held after the engine process is gone."""
        if self._closing or self.serving.draining or self._leaving is not None:
            return
        self._leaving = asyncio.get_running_loop().create_task(self._leave(), name="engine-lost")

    def engine_gone(self) -> bool:
        """Whether the engine process has exited: its pidfd says so at once; without one, this process was handed to
        another parent (which the kernel does after closing the dead process's sockets, so it may lag)."""
        if self._engine_fd is not None and select.select([self._engine_fd], [], [], 0)[0]:
            return True
        return os.getppid() != self.engine_pid

    async def _leave(self) -> None:
        deadline = time.monotonic() + ORPHANED_WAIT_S
        while not self.engine_gone() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.engine_gone():
            why = "the engine process (pid %d) is gone; exiting, which frees the port"
        else:
            why = "lost its connection to the engine process (pid %d); exiting, to be restarted"
        log.error("front-end %d (pid %d): " + why, self.index, os.getpid(), self.engine_pid)
        self.engine_lost = True
        if self.exit is not None:
            self.exit()

    async def _stop(self) -> None:
        self._closing = True
        if self._flusher is not None:
            self._flusher.cancel()
        if self.client is not None:
            self.client.flush()
            if self.client.transport is not None:
                self.client.transport.close()
        for http in (self.http, self.probes):
            if http is not None:
                await http.aclose()

    async def _relay(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Forward a request to the engine process's HTTP server and stream its answer back.

        Every relayed route is a small one (a listing, a management call): a body over
        :data:`~halfserve.api.http.deps.MANAGEMENT_BODY_BYTES` is a 413, before any of it is read when its length is
        declared. A body is read whole here before the engine process is asked (bounded by that limit, and by the
        body timeout and rate): a slow upload then holds only its own connection, never one of the few to the engine
        process that every relayed route shares. The engine process learns the client's address from
        :data:`RELAYED_CLIENT`, for its admin token checks.

        A body past the limit is refused only where a route takes the request: the engine process is asked that,
        without the body (:data:`ROUTE_ONLY`), and where none does, its 404 or 405 is the answer, as without
        front-ends (a 413 had said "too large" of a request that no route takes); its 413 is worded as the engine
        process words it and carries the request's id. A GET's or HEAD's body past the limit is not read: the
        request is relayed without it, as one process answers it (no route reads such a body).
        """
        declared = scope_header(scope, b"content-length")
        headers = [(k, v) for k, v in scope["headers"] if k not in HOP_BY_HOP and k not in (RELAYED_CLIENT, ROUTE_ONLY)]
        client = scope.get("client")
        if client:
            headers.append((RELAYED_CLIENT, str(client[0]).encode("latin-1")))
        # No route reads a GET's or HEAD's body (one process leaves it unread): one past the cap is relayed without it.
        ignored = scope["method"] in ("GET", "HEAD")
        content: bytes | None = None
        if declared is not None and declared.isdigit() and int(declared) > RELAY_BODY_BYTES:
            if not ignored:
                too_large = too_large_message(declared.decode(), RELAY_BODY_BYTES, MANAGEMENT_LIMIT)
                await self._refuse_body(scope, receive, send, headers, too_large)
                return
        elif declared is not None or scope_header(scope, b"transfer-encoding") is not None:
            try:
                content = await _body(receive)
            except _ClientGone:
                return  # nobody to answer
            except _TooLarge:
                if not ignored:
                    too_large = too_large_message(None, RELAY_BODY_BYTES, MANAGEMENT_LIMIT)
                    await self._refuse_body(scope, receive, send, headers, too_large)
                    return
            if declared is not None and content is not None:
                headers.append((b"content-length", declared))  # the body goes on as sent, not re-chunked
        response = await self._ask(scope, receive, send, headers, content)
        if response is None:
            return
        try:
            if scope["method"] not in ("GET", "HEAD") and response.status_code < 400:
                # A change (a model loaded, a region registered) is answered once every front-end knows it: the
                # client's next request may reach any of them.
                assert self.client is not None
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self.client.publish(), PUBLISH_WAIT_S)
            await _pass_on(scope, send, response)
        finally:
            await response.aclose()

    async def _refuse_body(
        self, scope: Scope, receive: Receive, send: Send, headers: list[tuple[bytes, bytes]], too_large: str
    ) -> None:
        """A body past :data:`RELAY_BODY_BYTES`: the 413 ``too_large`` where a route takes the request, or else the
        engine process's answer to it without the body (the router's 404 or 405: no route ran)."""
        response = await self._ask(scope, receive, send, [*headers, (ROUTE_ONLY, b"1")], b"")
        if response is None:
            return
        try:
            if ROUTE_ONLY.decode() in response.headers:
                await error_response(413, too_large, {REQUEST_ID_HEADER: scope_request_id(scope).decode()})(
                    scope, receive, send
                )
            else:
                await _pass_on(scope, send, response)
        finally:
            await response.aclose()

    async def _ask(
        self, scope: Scope, receive: Receive, send: Send, headers: list[tuple[bytes, bytes]], content: bytes | None
    ) -> httpx.Response | None:
        """The engine process's answer to the request, streamed; None where it is not answering (the client has had
        a 503 saying so)."""
        assert self.http is not None
        assert self.probes is not None
        target = scope.get("raw_path") or scope["path"].encode()
        if scope.get("query_string"):
            target += b"?" + scope["query_string"]
        http = self.probes if scope["path"] in PROBE_PATHS else self.http
        request = http.build_request(scope["method"], target.decode("latin-1"), headers=headers, content=content)
        try:
            return await http.send(request, stream=True)
        except httpx.TransportError as e:
            message = f"the engine process is not answering ({type(e).__name__})"
            await error_response(503, message)(scope, receive, send)
            return None


async def _pass_on(scope: Scope, send: Send, response: httpx.Response) -> None:
    """The engine process's answer, sent on to the client."""
    out_headers = _answer_headers(response.headers.raw)
    if "content-length" not in response.headers and _has_body(scope["method"], response.status_code):
        # An answer the engine process streamed: gathered (as sent: still compressed, if it is), so it too goes out
        # with a length.
        body = b"".join([chunk async for chunk in response.aiter_raw()])
        out_headers.append((b"content-length", str(len(body)).encode()))
        await send({"type": "http.response.start", "status": response.status_code, "headers": out_headers})
        await send({"type": "http.response.body", "body": body})
        return
    await send({"type": "http.response.start", "status": response.status_code, "headers": out_headers})
    async for chunk in response.aiter_raw():
        await send({"type": "http.response.body", "body": chunk, "more_body": True})
    await send({"type": "http.response.body", "body": b""})


def _answer_headers(raw: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """The engine process's answer headers as the client gets them. Its ``content-length`` is kept (the body is
    relayed as its raw bytes, so the length holds): without one the front-end would send the answer chunked, which an
    HTTP/1.0 client cannot read (RFC 9112 section 6.1), where a single-process server sends a length."""
    out: list[tuple[bytes, bytes]] = []
    for key, value in raw:
        name = key.lower()
        if name == b"content-length" or (name not in HOP_BY_HOP and name not in FRONTEND_SETS):
            out.append((name, value))
    return out


def _has_body(method: str, status: int) -> bool:
    return method != "HEAD" and status >= 200 and status not in (204, 304)


RELAY_BODY_BYTES = MANAGEMENT_BODY_BYTES
"""Largest body a front-end relays: every route it relays is a listing or a management call."""


class _ClientGone(Exception):
    """The client went away before its body was whole."""


class _TooLarge(Exception):
    """The body grew past :data:`RELAY_BODY_BYTES`."""


async def _body(receive: Receive) -> bytes:
    """A request's whole body, for the relay's upstream request: refused once it passes :data:`RELAY_BODY_BYTES`."""
    chunks: list[bytes] = []
    received = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _ClientGone
        chunk = message.get("body", b"")
        received += len(chunk)
        if received > RELAY_BODY_BYTES:
            raise _TooLarge
        chunks.append(chunk)
        if not message.get("more_body"):
            return b"".join(chunks)


def run(
    settings: Settings,
    sock: socket.socket,
    api_socket: str,
    backplane_socket: str,
    secret: str,
    index: int,
    engine_pid: int,
) -> None:
    """A front-end process's main: serve ``sock`` (the listening socket every front-end shares) until told to stop,
    or until its connection to the engine process ``engine_pid`` is lost (then it exits with status 1)."""

    log_config = logs.configure(settings.log_format, settings.log_level.value, settings.access_log)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per relayed request otherwise
    app = FrontendApp(settings, api_socket, backplane_socket, secret, index, engine_pid)
    server = DrainingServer(uvicorn_config(app, settings, log_config, direct_routes(app)), app.begin_drain)
    app.exit = lambda: server.handle_exit(signal.SIGTERM, None)
    server.run(sockets=[sock])
    if app.engine_lost:
        if app.engine_gone():  # its temporary folder (the two sockets) is left to nobody else
            shutil.rmtree(os.path.dirname(api_socket), ignore_errors=True)
        server.exit_past_drain(1)
        sys.exit(1)
    server.exit_past_drain(0)
