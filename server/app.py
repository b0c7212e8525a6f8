"""The application: ``create_app(settings)`` and the lifespan that loads, serves and drains the models."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator, Callable
from types import FrameType
from typing import Any

import torch
import uvicorn
from fastapi import FastAPI
from starlette.types import ASGIApp

from server import __version__, api, precision
from server.api.shm import Regions
from server.backplane import Backplane, Frontends
from server.metrics import Metrics
from server.repository import ModelRepository, gil_switch_interval_ms
from server.settings import Settings
from server.transport import HttpLimits, LimitedHttpProtocol

log = logging.getLogger(__name__)

_LAST_BATCH_GRACE_S = 1.0


async def _load(repo: ModelRepository) -> None:
    await repo.load_all()
    # Move everything alive after loading (torch's modules, the weights' Python objects: ~250k) out of the
    # collector's reach. Without it, full collections over that heap stalled every request for tens of
    # milliseconds: p99 103 ms -> 15 ms at 64 concurrent requests on the benchmark MLP.
    gc.collect()
    gc.freeze()


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


def begin_drain(app: FastAPI) -> None:
    """Mark ``app`` as shutting down: readiness answers 503 from now on; requests already accepted are answered."""
    if not getattr(app.state, "draining", False):
        app.state.drain_started = time.monotonic()
    app.state.draining = True
    frontends: Frontends | None = getattr(app.state, "frontends", None)
    if frontends is not None:
        frontends.stop()


async def _drain(repo: ModelRepository, timeout: float) -> None:
    """Answer what the batchers still hold, then release the engines; past ``timeout`` stop waiting."""
    try:
        await asyncio.wait_for(repo.close(), timeout=timeout)
    except asyncio.TimeoutError:
        log.error("drain did not finish in time; exiting with requests unanswered")
    for name, served in repo.models.items():
        s = served.final_stats
        if s is not None:
            # Once drained, every accepted request was answered with outputs or failed (expired, failed in the model,
            # abandoned by its caller); refusals at admission (queue full, too many rows) were never accepted.
            log.info(
                "model %s drained: %d requests accepted, %d answered with outputs, %d not, %d refused at admission",
                name,
                s.requests,
                s.succeeded,
                s.requests - s.succeeded,
                s.rejected,
            )


def serving_threads() -> int:
    """torch intra-op threads when none are set: every core this process may run on (its affinity, which a
    container's CPU set narrows)."""
    return len(os.sched_getaffinity(0))


def create_app(settings: Settings | None = None, frontends: Frontends | None = None) -> FastAPI:
    """Build the FastAPI app for ``settings``. Manifests are validated when the lifespan starts (fail fast);
    weights load and warm up in the background while ``/ready`` answers 503.

    With ``frontends``, this process is the engine process: it starts them and serves their inference requests over
    the backplane (:mod:`server.backplane`), and on shutdown lets them drain before draining its batchers.
    """
    settings = settings or Settings()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        torch.set_num_threads(settings.threads or serving_threads())
        precision.set_tf32(settings.tf32)
        metrics = Metrics()
        repo = ModelRepository(settings, observe=metrics.batch_observer)
        interval = gil_switch_interval_ms(settings, repo.device.type)
        if interval is not None:
            sys.setswitchinterval(interval / 1000.0)
        repo.discover()
        metrics.watch(lambda: repo.models.values())
        app.state.repository = repo
        app.state.metrics = metrics
        app.state.draining = False
        loading = asyncio.create_task(_load(repo), name="load-models")
        backplane, watching = None, None
        if frontends is not None:
            backplane = Backplane(
                frontends.backplane_socket, repo, metrics, settings.http_workers, app.state.shm, frontends.secret
            )
            await backplane.start()
            frontends.start()
            watching = asyncio.create_task(frontends.watch(), name="watch-frontends")
        app.state.frontends = frontends
        app.state.backplane = backplane
        try:
            yield
        finally:
            # Under uvicorn this runs after the server stopped listening and its requests in flight were answered
            # (or cancelled at the drain timeout); what is still queued now belongs to no caller or a late one.
            begin_drain(app)
            if frontends is not None and backplane is not None and watching is not None:
                # The front-ends answer what they hold through the backplane, so it and the engines outlive them.
                watching.cancel()
                await frontends.join(settings.drain_timeout)
                await backplane.close()
            loading.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await loading
            # One drain_timeout in all from the signal, uvicorn's wait included; at least a moment for the batch
            # that is running.
            spent = time.monotonic() - app.state.drain_started
            await _drain(repo, max(settings.drain_timeout - spent, _LAST_BATCH_GRACE_S))

    app = api.App(
        title="halfserve",
        version=__version__,
        description="Half-precision PyTorch inference with dynamic batching.",
        lifespan=lifespan,
        docs_url=None,  # server.api.docs: a pinned Swagger UI, or none
        redoc_url=None,
    )
    app.state.settings = settings
    app.state.shm = Regions()
    api.install(app)
    return app
