"""TorchServe's management API, its read side, on a port of its own (``torchserve_management_port``, as TorchServe's
8081): ``GET /models`` lists the served models as ``{"nextPageToken"?, "models": [{"modelName", "modelUrl"}]}``, a
page at a time (``limit``, ``next_page_token``), and ``GET /models/{name}[/{version}|/all]`` describes one as
TorchServe's ``DescribeModelResponse`` does, filled from what this server knows of it: its engine instances as
workers, its batching limits, its device, its queue.

The main port answers ``GET /models`` in this server's own shape, so TorchServe's shape needs a port of its own, as
TorchServe's management API has. Its calls that change something (register, scale workers, unregister, set the
default version) are refused with TorchServe's 405 and the management call of this server to use instead.
"""

from __future__ import annotations

import datetime
import functools
import os
import re
from typing import Any, TypeVar

import orjson
from starlette.applications import Starlette
from starlette.datastructures import State
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Match, Route
from starlette.types import Receive, Scope, Send

from halfserve.api.errors import APIError
from halfserve.api.http import deps, guard
from halfserve.api.http.telemetry import Endpoint
from halfserve.api.http.torchserve import NOT_ALLOWED_MESSAGE, NOT_FOUND_MESSAGE, error, version_named
from halfserve.serving import AppState, LocalModel, ModelState

DEFAULT_LIMIT = 100
"""Models per page of ``GET /models``: TorchServe's default, and its most (a ``limit`` outside 0..100 is 100, as
TorchServe takes it)."""
ALL_VERSIONS = "all"
"""The version segment that describes every version of a model."""
RUNTIME = "python"
"""``runtime``: TorchServe's name for a model its Python backend serves."""
WORKER_READY = "READY"
WORKER_NOT_SERVING = "UNLOADING"
"""TorchServe's two worker statuses: a worker serving its model, and any other."""

_USE_INSTEAD = {
    "register": "POST /models/{name}/load on the main port, with the admin token (halfserve import puts a .mar "
    "archive in the store first)",
    "scale": "the manifest's execution.instances, then POST /models/{name}/reload on the main port, with the admin "
    "token",
    "unregister": "POST /models/{name}/unload on the main port, with the admin token",
    "set-default": 'POST /models/{name}/load with {"version": N} on the main port, with the admin token',
}
"""This server's management call for each of TorchServe's calls that change something."""


_INTEGER = re.compile(r"[0-9]+", re.ASCII)
_DIGITS = 18
_FAR: int = 10**_DIGITS
"""Digits read of an integer query parameter: more is past any page (TorchServe's own parse would overflow)."""


def _json(obj: object) -> Response:
    return Response(orjson.dumps(obj), media_type="application/json")


def _query_int(request: Request, name: str, default: int) -> int:
    """The integer query parameter ``name``, or ``default`` when absent; a 400 naming it when it is not a count in
    ASCII digits (TorchServe would take the default silently, or page 0 for a negative token, which pages a poller
    through the wrong models)."""
    raw = request.query_params.get(name)
    if raw is None or raw == "":
        return default
    if _INTEGER.fullmatch(raw) is None:  # int() takes "-1", "+1", "1_0", " 1" and other scripts' digits too
        raise APIError(400, f"{name}: expected an integer (ASCII digits), got {raw[:40]!r}")
    return int(raw) if len(raw) <= _DIGITS else _FAR


def _torchserve_errors(endpoint: Endpoint) -> Endpoint:
    """``endpoint``, its :class:`~halfserve.api.errors.APIError` answered in TorchServe's shape."""

    @functools.wraps(endpoint)
    async def answer(request: Request) -> Response:
        try:
            return await endpoint(request)
        except APIError as e:
            return error(e.status, e.message, headers=e.headers)

    return answer


def model_url(model: LocalModel) -> str:
    """``modelUrl``: where the model's served version lies, as the store names it (``<name>/<version>``), for the
    ``.mar`` file TorchServe names there."""
    return f"{model.name}/{model.version}"


@_torchserve_errors
async def list_models(request: Request) -> Response:
    """``GET /models``: the served models by name, ``limit`` at a time from ``next_page_token`` (a position in the
    names' order), with ``nextPageToken`` while more follow."""
    limit = _query_int(request, "limit", DEFAULT_LIMIT)
    start = _query_int(request, "next_page_token", 0)
    models = deps.repository(request).models
    if limit > DEFAULT_LIMIT:
        limit = DEFAULT_LIMIT
    names = sorted(models)
    end = start + limit
    body: dict[str, Any] = {}
    if end < len(names):
        body["nextPageToken"] = str(end)
    body["models"] = [{"modelName": n, "modelUrl": model_url(models[n])} for n in names[start:end]]
    return _json(body)


@_torchserve_errors
async def describe_model(request: Request) -> Response:
    """``GET /models/{model_name}[/{version}]``: a list of one description, of the version served; ``/all``: of every
    version served (this server serves one version of a model at a time)."""
    name: str = request.path_params["model_name"]
    version: str | None = request.path_params.get("version")
    model = deps.repository(request).models.get(name)
    if model is None:
        return error(404, f"Model not found: {name}", "ModelNotFoundException")
    if version not in (None, ALL_VERSIONS) and not same_version(version, model.version):
        message = f"Model version: {version} does not exist for model: {name} (it serves version {model.version})"
        return error(404, message, "ModelVersionNotFoundException")
    return _json([describe(model)])


def same_version(asked: str, served: int) -> bool:
    """Whether ``asked`` names version ``served``: ``2`` as this server spells it, or ``2.0`` as TorchServe's
    archives do."""
    return version_named(asked) == str(served)


def _timestamp(seconds: float) -> str:
    """A time as TorchServe writes a worker's ``startTime``: ISO 8601 in UTC, to the millisecond."""
    moment = datetime.datetime.fromtimestamp(seconds, tz=datetime.UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"


def _milliseconds(value: float) -> float | int:
    return int(value) if float(value).is_integer() else value


T = TypeVar("T")


def _of(kind: type[T], value: object, default: T) -> T:
    """``value`` when it is a ``kind``, else ``default``: a listing's entry, which is typed ``object``."""
    return value if isinstance(value, kind) else default


def describe(model: LocalModel) -> dict[str, object]:
    """One model as TorchServe's ``DescribeModelResponse`` shows it: its engine instances are its workers (none while
    it has no engine), each of whose ``pid`` is its instance process's, or this process's for an instance thread.

    What this server has no value for is shown as TorchServe shows it when it has none: ``memoryUsage`` 0 (an
    instance thread shares its process's memory with every other model's), ``gpuUsage`` ``"N/A"``.
    """
    listing = model.describe()
    execution = listing.get("execution")
    instances = _of(int, execution.get("instances") if isinstance(execution, dict) else None, 1)
    stats = model.stats() or {}
    device = listing.get("device")
    workers: list[dict[str, object]] = []
    if isinstance(device, str):  # the engine is loaded
        pids = _of(list, stats.get("instance_pids"), [])
        status = WORKER_READY if model.state is ModelState.READY else WORKER_NOT_SERVING
        started = _of(float, listing.get("loaded_at"), 0.0)
        for i in range(instances):
            workers.append(
                {
                    "id": str(i),
                    "startTime": _timestamp(started),
                    "status": status,
                    "memoryUsage": 0,
                    "pid": pids[i] if i < len(pids) else os.getpid(),
                    "gpu": device.startswith("cuda"),
                    "gpuUsage": "N/A",
                }
            )
    batching = model.batching
    described: dict[str, object] = {
        "modelName": model.name,
        "modelVersion": str(model.version),
        "modelUrl": model_url(model),
        "runtime": RUNTIME,
        "minWorkers": instances,
        "maxWorkers": instances,
        "batchSize": batching.max_batch_size,
        "maxBatchDelay": _milliseconds(batching.max_delay_ms),
        "loadedAtStartup": True,
        "workers": workers,
    }
    if stats:
        queued = _of(int, stats.get("queued_rows"), 0)
        described["jobQueueStatus"] = {
            "remainingCapacity": max(batching.max_queue_rows - queued, 0),
            "pendingRequests": queued,
        }
    return described


async def refuse_change(request: Request) -> Response:
    """A call of TorchServe's that changes something: 405, naming this server's call to use instead."""
    path = request.url.path
    method = request.scope["method"]
    if method == "POST":
        call = "register"
    elif method == "DELETE":
        call = "unregister"
    elif path.endswith("/set-default"):
        call = "set-default"
    else:
        call = "scale"
    name = request.path_params.get("model_name", "{name}")
    instead = _USE_INSTEAD[call].replace("{name}", name[:100])
    message = (
        f"{method} {path[:200]}: this port serves TorchServe's management API read side only (GET /models, "
        f"GET /models/{{name}}); use {instead}"
    )
    return error(405, message, "MethodNotAllowedException", _allow(request.scope))


def _allow(scope: Scope) -> dict[str, str]:
    """A 405's ``Allow`` for the path of ``scope`` (RFC 9110 section 15.5.6: the origin server MUST send one): the
    methods answered there rather than refused, ``GET, HEAD`` on the read routes (Starlette answers HEAD wherever
    GET is), none on set-default, whose one method is refused."""
    readable = any(route.matches({**scope, "method": "GET"})[0] is Match.FULL for route in ROUTES)
    return {"Allow": "GET, HEAD" if readable else ""}


async def _not_found(request: Request, exc: Exception) -> Response:
    if isinstance(exc, HTTPException) and exc.status_code == 405:
        return error(405, NOT_ALLOWED_MESSAGE, "MethodNotAllowedException", _allow(request.scope))
    return error(404, NOT_FOUND_MESSAGE, "ResourceNotFoundException")


ROUTES = [
    Route("/models", list_models, methods=["GET"]),
    Route("/models", refuse_change, methods=["POST"]),
    Route("/models/{model_name}", describe_model, methods=["GET"]),
    Route("/models/{model_name}", refuse_change, methods=["PUT", "DELETE"]),
    Route("/models/{model_name}/{version}", describe_model, methods=["GET"]),
    Route("/models/{model_name}/{version}", refuse_change, methods=["PUT", "DELETE"]),
    Route("/models/{model_name}/{version}/set-default", refuse_change, methods=["PUT"]),
]
"""The routes: the read side answered, the write side refused."""


class ManagementApp:
    """TorchServe's management API for the models of ``state``, behind the checks every request to the main port
    passes first (:mod:`~halfserve.api.http.guard`: the ``Host``, browsers' cross-origin requests)."""

    def __init__(self, state: AppState) -> None:
        self.state = State({"serving": state})
        self._app = Starlette(routes=ROUTES, exception_handlers={404: _not_found, 405: _not_found})
        # TorchServe answers a trailing slash as any other path; Starlette's redirect would name a Location built
        # from the request's Host header.
        self._app.router.redirect_slashes = False
        self._app.state.serving = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not await guard.admitted(scope, receive, send, self.state.serving.settings):
            return
        await self._app(scope, receive, send)
