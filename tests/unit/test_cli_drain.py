"""The serve command's shutdown: the first signal turns readiness off before uvicorn starts its drain, and the drain
answers the connections the kernel had accepted for the server."""

from __future__ import annotations

import asyncio
import signal
import socket
from pathlib import Path
from typing import Any

import uvicorn

from halfserve.app import begin_drain, create_app
from halfserve.cli import build_parser, listen
from halfserve.httpserver import DrainingServer, uvicorn_config
from halfserve.settings import Settings
from tests.waiting import DEADLINE_S


def test_the_signal_marks_the_app_draining_and_lets_uvicorn_shut_down(tmp_path: Path) -> None:
    app = create_app(Settings(store=tmp_path))
    app.state.serving.draining = False
    server = DrainingServer(uvicorn.Config(app), lambda: begin_drain(app))
    server.handle_exit(signal.SIGTERM, None)
    assert app.state.serving.draining is True
    assert server.should_exit


def test_drain_timeout_and_limits_are_serve_flags() -> None:
    args = build_parser().parse_args(
        ["serve", "--drain-timeout", "2.5", "--request-timeout-ms", "40", "--max-body-bytes", "4096"]
    )
    fields = {k: v for k, v in vars(args).items() if k in Settings.model_fields and v is not None}
    settings = Settings(**fields)
    assert (settings.drain_timeout, settings.request_timeout_ms, settings.max_body_bytes) == (2.5, 40.0, 4096)


async def _health(scope: Any, receive: Any, send: Any) -> None:
    if scope["type"] == "http":
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"{}"})


def test_a_drain_answers_a_connection_still_waiting_to_be_accepted() -> None:
    """The kernel accepts a connection before the server takes it; one still waiting when the drain closed the
    listening socket was reset, with the request its client had written on it. (With front-ends, the clients whose
    connections one front-end's drain had closed connected again into it while another closed its copy.)"""
    listening = listen("127.0.0.1", 0)
    server = DrainingServer(uvicorn_config(_health, Settings(), None, lifespan="off"), lambda: None)

    async def scenario() -> bytes:
        server.config.load()
        server.lifespan = server.config.lifespan_class(server.config)
        await server.startup(sockets=[listening])
        with socket.create_connection(listening.getsockname()) as client:
            client.sendall(b"GET /health HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n")
            await server.shutdown(sockets=[listening])  # the loop has not run since: the server has not taken it
            client.settimeout(DEADLINE_S)
            return client.recv(65536)

    answer = asyncio.run(scenario())
    assert answer.startswith(b"HTTP/1.1 200 OK")
    assert b"connection: close" in answer
