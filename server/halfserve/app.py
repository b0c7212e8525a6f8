"""The application: ``create_app(settings)`` and the lifespan that loads, serves and drains the models."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import time
from collections.abc import AsyncIterator

import torch
from fastapi import FastAPI

from halfserve import collector, compilation, models, placement, precision
from halfserve.api import http
from halfserve.api.grpc.grpc_service import GrpcServer
from halfserve.api.http.torchserve_management import ManagementApp
from halfserve.httpserver import Listener
from halfserve.metrics import Metrics
from halfserve.multiproc.engine_side import Backplane
from halfserve.multiproc.supervisor import Frontends
from halfserve.regions import Regions
from halfserve.repository import ModelRepository, gil_switch_interval_ms
from halfserve.serving import AppState, NoModels
from halfserve.settings import Settings
from halfserve.version import __version__

log = logging.getLogger(__name__)

_LAST_BATCH_GRACE_S = 1.0


async def _load(repo: ModelRepository) -> None:
    await repo.load_all()
    collector.settle()  # torch's modules and the weights' Python objects are in place now


def begin_drain(app: FastAPI) -> None:
    """Mark ``app`` as shutting down: readiness answers 503 from now on; requests already accepted are answered."""
    state: AppState = app.state.serving
    if not state.draining:
        state.drain_started = time.monotonic()
    state.draining = True
    frontends: Frontends | None = getattr(app.state, "frontends", None)
    if frontends is not None:
        frontends.stop()
    grpc_server: GrpcServer | None = getattr(app.state, "grpc", None)
    if grpc_server is not None:
        grpc_server.begin_stop(state.settings.drain_timeout)


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


def create_app(settings: Settings | None = None, frontends: Frontends | None = None) -> http.App:
    """Build the FastAPI app for ``settings``. Manifests are validated when the lifespan starts (fail fast);
    weights load and warm up in the background while ``/ready`` answers 503.

    With ``frontends``, this process is the engine process: it starts them and serves their inference requests over
    the backplane (:mod:`halfserve.multiproc`), and on shutdown lets them drain before draining its batchers.
    """
    settings = settings or Settings()
    regions = Regions(settings.max_shm_regions)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # Process-wide settings, applied here once (never by a constructor).
        torch.set_num_threads(settings.threads or placement.available_cores())
        models.add_code_path(settings.code_path)
        models.forbid_store(settings.store)
        precision.set_tf32(settings.tf32)
        metrics = Metrics()
        repo = ModelRepository(settings, observe=metrics.batch_observer)
        interval = gil_switch_interval_ms(settings, repo.device.type)
        if interval is not None:
            sys.setswitchinterval(interval / 1000.0)
        repo.discover()
        compilation.tune_cudnn(repo.device, repo.fixed_shapes())
        metrics.watch(lambda: repo.models.values())
        state = AppState(settings, repo, regions, metrics, repository=repo)
        app.state.serving = state
        loading = asyncio.create_task(_load(repo), name="load-models")
        backplane, watching = None, None
        app.state.frontends = frontends
        started = False
        try:
            # Inside the try: a start-up failure past this point (the gRPC port taken) stops the front-ends already
            # spawned and the models loading, so the process exits at once instead of waiting on its children.
            if frontends is not None:
                backplane = Backplane(
                    frontends.backplane_socket,
                    repo,
                    metrics,
                    settings.http_workers,
                    regions,
                    frontends.secret,
                    frontends.connected.add,
                )
                state.pending.append(backplane.missing)
                state.published = backplane.publish
                await backplane.start()
                frontends.start()
                watching = asyncio.create_task(frontends.watch(), name="watch-frontends")
            if settings.grpc:
                # After the front-ends are spawned: nothing of gRPC's runtime is in a process that starts them.
                app.state.grpc = GrpcServer(state)
                await app.state.grpc.start()
            if settings.torchserve_management_port is not None:
                # In this process, the one that holds the models, whatever the front-ends (--http-workers).
                port = settings.torchserve_management_port
                what, flag = "TorchServe's management API", "--torchserve-management-port"
                app.state.torchserve_management = Listener(ManagementApp(state), settings, port, what, flag)
                await app.state.torchserve_management.start()
            started = True
            yield
        except Exception as e:
            if not started:
                app.state.startup_error = e
            raise
        finally:
            # Under uvicorn this runs after the server stopped listening and its requests in flight were answered
            # (or cancelled at the drain timeout); what is still queued now belongs to no caller or a late one.
            begin_drain(app)
            if watching is not None:
                watching.cancel()
            if frontends is not None:
                # The front-ends answer what they hold through the backplane, so it and the engines outlive them;
                # at a failed start they hold nothing.
                await frontends.join(settings.drain_timeout if started else 0.0)
            if backplane is not None:
                await backplane.close()
            grpc_server: GrpcServer | None = getattr(app.state, "grpc", None)
            if grpc_server is not None:
                # Begun with the drain: its calls in flight are answered (or cut off at the drain timeout) first.
                await grpc_server.stopped(settings.drain_timeout)
            management: Listener | None = getattr(app.state, "torchserve_management", None)
            if management is not None:
                await management.stop()
            loading.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await loading
            # One drain_timeout in all from the signal, uvicorn's wait included; at least a moment for the batch
            # that is running.
            spent = time.monotonic() - (state.drain_started or time.monotonic())
            await _drain(repo, max(settings.drain_timeout - spent, _LAST_BATCH_GRACE_S))

    app = http.App(
        title="halfserve",
        version=__version__,
        description="Half-precision PyTorch inference with dynamic batching.",
        lifespan=lifespan,
        docs_url=None,  # halfserve.api.http.docs: a pinned Swagger UI, or none
        redoc_url=None,
    )
    # Until the lifespan starts, the state has no models (no request is answered before it has).
    app.state.serving = AppState(settings, NoModels(), regions)
    http.install(app)
    return app
