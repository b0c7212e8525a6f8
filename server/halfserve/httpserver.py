"""The uvicorn server that runs an app over the server's HTTP protocol (:mod:`halfserve.httpprotocol`), held to the
settings' connection limits, for the server and its front-ends: :func:`uvicorn_config`, :class:`DrainingServer`,
which tells the app the moment a shutdown signal arrives, and :class:`Listener`, a second port served from a running
app's event loop."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

import uvicorn
from starlette.types import ASGIApp

from halfserve import handlers
from halfserve.httpprotocol import HttpLimits, LimitedHttpProtocol
from halfserve.settings import Settings
from halfserve.transport import Direct

log = logging.getLogger(__name__)


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
        self._signalled: float | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._signalled is None:
            self._signalled = time.monotonic()
        self._on_signal()
        super().handle_exit(sig, frame)

    def exit_past_drain(self, code: int) -> None:
        """After :meth:`run`: end the process with ``code`` now if handler calls still run once the drain timeout from
        the signal has passed, naming their models; return as soon as none do.

        Python cannot stop a thread, and its exit waits for every one: a handler call that hung past its time limit
        (answered long ago) kept the process alive for as long as it ran, past the drain timeout that promises the
        exit, and forever for one that never returns."""
        budget = float(self.config.timeout_graceful_shutdown or 0.0)
        left = handlers.abandon((self._signalled or time.monotonic()) + budget)
        if not left:
            return
        calls = ", ".join(f"model {model!r}: {n}" for model, n in sorted(left.items()))
        log.error("drain: handler calls still running past the drain timeout are abandoned (%s); exiting", calls)
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os._exit(code)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's shutdown, after taking the connections waiting to be accepted; then ``on_shutdown``; a SIGTERM
        that was drained is not raised again.

        A connection the kernel had accepted (the client's request written on it, perhaps) but this process had not
        yet taken was reset when the listening socket closed: with front-ends, the connections that one front-end's
        drain had just closed were opened again into the backlog while another was closing its copy. They are taken
        and drained as the others are (their request answered with ``connection: close``).

        uvicorn re-raises the signal it caught once it has shut down, so that the default handler ends the process:
        no ``finally`` after :meth:`run` would then run (the front-ends' temporary directory was left behind), and
        the exit status was -SIGTERM rather than the 0 a drained shutdown promises. SIGINT is still re-raised.
        """
        await self._take_backlog()
        await super().shutdown(sockets)
        if self._on_shutdown is not None:
            self._on_shutdown()
        captured: list[int] = getattr(self, "_captured_signals", [])
        captured[:] = [sig for sig in captured if sig != signal.SIGTERM]

    async def _take_backlog(self) -> None:
        backlog: list[socket.socket] = []
        for server in self.servers:
            for listening in server.sockets:
                # A duplicate: the loop's own object for it (uvloop's) cannot accept.
                with socket.fromfd(listening.fileno(), listening.family, listening.type) as sock:
                    sock.setblocking(False)
                    with contextlib.suppress(OSError):  # BlockingIOError once the backlog is empty
                        while True:
                            connection = sock.accept()[0]
                            connection.setblocking(False)
                            backlog.append(connection)
            server.close()  # at once: nothing more is let in between the last accept and the close
        if backlog:
            log.info("drain: %d connection(s) still waiting to be accepted are answered too", len(backlog))
        config = self.config

        def protocol() -> asyncio.Protocol:  # as uvicorn's startup makes each connection's
            return config.http_protocol_class(  # type: ignore[call-arg]
                config=config, server_state=self.server_state, app_state=self.lifespan.state
            )

        for connection in backlog:
            await asyncio.get_running_loop().connect_accepted_socket(protocol, connection, ssl=config.ssl)


def http_limits(settings: Settings) -> HttpLimits:
    return HttpLimits(**{f.name: getattr(settings, f.name) for f in dataclasses.fields(HttpLimits)})


def uvicorn_config(
    app: ASGIApp, settings: Settings, log_config: dict[str, Any] | None, direct: Direct | None = None, **where: Any
) -> uvicorn.Config:
    """uvicorn's configuration for ``app`` under ``settings``, with ``direct`` the routes answered straight from the
    protocol; ``where`` is where it listens (host and port, uds), if not on sockets handed to ``run``."""
    return uvicorn.Config(
        app,
        **where,
        http=LimitedHttpProtocol.with_limits(http_limits(settings), direct),
        # No route is a WebSocket: an Upgrade request is answered as plain HTTP. With uvicorn's default ("auto", and
        # the websockets package installed), it was handed to a WebSocket protocol that has none of the connection's
        # limits, and the app, which answers only HTTP, left it open and unanswered.
        ws="none",
        log_level=settings.log_level.value,
        log_config=log_config,
        access_log=settings.access_log,
        # uvicorn waits this long for requests in flight, then cancels them; float seconds work despite its hint.
        timeout_graceful_shutdown=settings.drain_timeout,  # type: ignore[arg-type]
    )


class Listener:
    """``app`` on ``settings.host``:``port``, served from the running event loop under the settings' connection limits,
    as the main port is: a port beside the main one, started and stopped by the main app's lifespan. It has no
    lifespan or signal handling of its own (the main server's are the process's)."""

    def __init__(self, app: ASGIApp, settings: Settings, port: int, what: str, flag: str) -> None:
        self._settings, self._port, self._what, self._flag = settings, port, what, flag
        self._server = uvicorn.Server(uvicorn_config(app, settings, None, lifespan="off"))
        self._socket: socket.socket | None = None

    async def start(self) -> None:
        """Bind and serve; an ``OSError`` naming the port and why when it cannot be bound."""
        host = self._settings.host
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, self._port))
        except OSError as e:
            sock.close()
            where = f"{host}:{self._port} ({self._flag})"
            raise OSError(f"{self._what}: cannot listen on {where}: {e.strerror or e}") from None
        config = self._server.config
        config.load()
        self._server.lifespan = config.lifespan_class(config)
        self._socket = sock
        await self._server.startup(sockets=[sock])
        log.info("%s on %s:%d", self._what, host, self._port)

    async def stop(self) -> None:
        """Stop taking connections; requests in flight are answered (up to the drain timeout, then cancelled)."""
        if self._socket is not None:
            sock, self._socket = self._socket, None
            await self._server.shutdown(sockets=[sock])
