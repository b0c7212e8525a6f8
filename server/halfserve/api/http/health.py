"""Health, readiness, model listings and per-model batching statistics (the server's own routes; V2's are in
:mod:`halfserve.api.http.v2`)."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from starlette.responses import Response

from halfserve.api.errors import APIError
from halfserve.api.http import deps
from halfserve.api.http.deps import json_response, repository
from halfserve.api.http.errors import error_response, error_responses, json_ok

router = APIRouter()

_OBJECT = {"type": "object"}


@router.get(
    "/health",
    response_class=Response,
    responses=json_ok("Live.", {"type": "object", "required": ["status"], "properties": {"status": {"const": "live"}}}),
)
async def health() -> Response:
    """Liveness: the process is up and its event loop answers."""
    return json_response({"status": "live"})


@router.get(
    "/ready",
    response_class=Response,
    responses={
        **json_ok("Every model is loaded and warm.", {"type": "object", "required": ["status", "models"]}),
        **error_responses({503: "A model is still loading or failed, or the server is draining."}),
    },
)
async def ready(request: Request) -> Response:
    """Readiness: 200 once every model is loaded and warmed up, 503 before (and while draining)."""
    app = deps.state(request)
    if app.draining:
        return error_response(503, "draining: the server is shutting down")
    why = deps.not_ready(request)
    if why:
        return error_response(503, f"not ready: {why}", {"Retry-After": "1"})
    states = {name: m.state.value for name, m in app.service.models.items()}
    return json_response({"status": "ready", "models": states})


@router.get(
    "/models",
    response_class=Response,
    responses=json_ok("The served models.", {"type": "object", "required": ["models"]}),
)
async def list_models(request: Request) -> Response:
    """Every served model with its version, device, precision, signature, batching limits and statistics; ``time``
    is the server's clock, so a poller can turn two listings' counters into rates."""
    models = [m.describe() for m in repository(request).models.values()]
    return json_response({"models": models, "time": time.time()})


@router.get(
    "/models/{name}",
    response_class=Response,
    responses={**json_ok("The model's entry, as in the listing.", _OBJECT), **error_responses({404: "Unknown model."})},
)
async def describe_model(name: str, request: Request) -> Response:
    """One model's entry of ``GET /models``: the same object, the listing's fields and values."""
    return json_response(repository(request).get(name).describe())


@router.get(
    "/models/{name}/stats",
    response_class=Response,
    responses={
        **json_ok("The model's statistics.", _OBJECT),
        **error_responses({404: "Unknown model.", 503: "The model is not loaded."}),
    },
)
async def model_stats(name: str, request: Request) -> Response:
    """Requests, rows, batches and the histogram of batch sizes the batcher has cut; failures isolated by splitting
    batches, the batch size in force (halved after an out-of-memory error) and half-precision overflows rerun in
    fp32."""
    served = repository(request).get(name)
    stats = served.stats()
    if stats is None:
        raise APIError(503, f"model {name!r} is {served.state.value}")
    return json_response({"model": name, "version": served.version, **stats})
