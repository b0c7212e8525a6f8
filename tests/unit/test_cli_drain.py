"""The serve command's shutdown hook: the first signal turns readiness off before uvicorn starts its drain."""

from __future__ import annotations

import signal
from pathlib import Path

import uvicorn

from halfserve.app import begin_drain, create_app
from halfserve.cli import build_parser
from halfserve.httpserver import DrainingServer
from halfserve.settings import Settings


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
