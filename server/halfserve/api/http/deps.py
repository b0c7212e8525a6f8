"""What the routes share: the app's state and its models, JSON answers, the admin guard, management bodies.

Routes reach the models only through :class:`~halfserve.serving.AppState`'s :class:`~halfserve.serving.ModelService`
(:func:`service`); the management and listing routes, which run only in the process that owns the models, through
its repository (:func:`repository`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import orjson
from fastapi import APIRouter, Depends
from fastapi.security import HTTPBearer
from starlette.requests import Request
from starlette.responses import Response

from halfserve.api.access import check_admin, of_version, why_not_ready
from halfserve.api.dataplane.bounds import parse_json
from halfserve.api.errors import APIError
from halfserve.api.http.errors import error_responses
from halfserve.api.http.limits import raw_header, read_body
from halfserve.serving import (
    AppState,
    LocalModel,
    ModelAdmin,
    ModelHandle,
    ModelService,
)
from halfserve.settings import Settings


def state(request: Request) -> AppState:
    """The app's state, as its app filled it."""
    found: AppState = request.app.state.serving
    return found


def service(request: Request) -> ModelService:
    """The served models."""
    return state(request).service


def settings(request: Request) -> Settings:
    return state(request).settings


def repository(request: Request) -> ModelAdmin:
    """The local repository: the management and listing routes run only where the models are (a front-end relays
    them)."""
    repo = state(request).repository
    if repo is None:
        raise APIError(503, "this process serves no model repository")
    return repo


def served_model(request: Request, name: str | None, version: str | None) -> ModelHandle:
    """The model ``name``, or a 404 when it is unknown or ``version`` is not the version it serves."""
    return of_version(service(request).get(name), version)


def local_model(request: Request, name: str, version: str | None) -> LocalModel:
    """:func:`served_model`, as the local repository holds it (for the routes only its process answers)."""
    return of_version(repository(request).get(name), version)


def not_ready(request: Request) -> str | None:
    """Why the server is not ready to take requests (draining, a model not ready, a front-end missing); None when it
    is."""
    return why_not_ready(state(request))


# Routes under /v2/models/{model_name}, each also under /versions/{model_version} --------------------------------------

MODEL = "/v2/models/{model_name}"
VERSIONED = MODEL + "/versions/{model_version}"
_VERSION_PARAMETER = {
    "name": "model_version",
    "in": "path",
    "required": True,
    "schema": {"type": "string"},
    "description": "The served version; any other is a 404.",
}
E = TypeVar("E", bound=Callable[..., Any])


def model_route(router: APIRouter, method: str, suffix: str = "", **options: Any) -> Callable[[E], E]:
    """Register an endpoint at ``/v2/models/{model_name}<suffix>`` and at its ``/versions/{model_version}`` twin,
    where it reads the version from ``request.path_params`` (None on the first)."""

    def register(endpoint: E) -> E:
        router.add_api_route(MODEL + suffix, endpoint, methods=[method], response_class=Response, **options)
        extra = options.get("openapi_extra") or {}
        parameters = [*extra.get("parameters", []), _VERSION_PARAMETER]
        versioned = {**options, "openapi_extra": {**extra, "parameters": parameters}}
        router.add_api_route(VERSIONED + suffix, endpoint, methods=[method], response_class=Response, **versioned)
        return endpoint

    return register


def version_of(request: Request) -> str | None:
    """The version a ``/versions/{model_version}`` URL names; None on the URL without it."""
    version: str | None = request.path_params.get("model_version")
    return version


def json_response(obj: object, status: int = 200) -> Response:
    return Response(orjson.dumps(obj), status_code=status, media_type="application/json")


# The admin guard ------------------------------------------------------------------------------------------------------

AUTH_ERRORS = error_responses(
    {
        400: "Malformed body.",
        401: "The Authorization: Bearer token is missing or wrong.",
        403: "The management API is off: the server has no admin token.",
        413: "A body over 64 KiB.",
        429: "A wrong token, after too many from this address or from all lately (Retry-After).",
    }
)
OPTIONAL_JSON_BODY: dict[str, Any] = {
    "requestBody": {"required": False, "content": {"application/json": {"schema": {"type": "object"}}}},
}
# Declares the bearer scheme in the OpenAPI schema; the check itself is require_admin's (403 when no token is set).
BEARER = [Depends(HTTPBearer(auto_error=False))]


RELAYED_CLIENT = b"x-halfserve-relayed-client"
"""The client's address on a request a front-end relays (``--http-workers``), which reaches this process over a Unix
socket that has no client address; a front-end drops the header from what clients send."""
ROUTE_ONLY = b"x-halfserve-route-only"
"""On a request a front-end relays without its body (one past the relay's cap, :data:`MANAGEMENT_BODY_BYTES`): the
engine process runs no route for it, and answers ``204`` with this header where a route takes it (the front-end then
refuses the body), or else the router's own 404 or 405, as the request with its body would have had. Honoured only
on the relay's Unix socket (no client address); a front-end drops the header from what clients send."""


def client_address(request: Request) -> str:
    """The address a request came from: its connection's, or on a relayed request the one the front-end saw."""
    if request.client is not None:
        return request.client.host
    return (raw_header(request, RELAYED_CLIENT) or b"").decode("latin-1")


def require_admin(request: Request) -> None:
    """Fail with 403 when no admin token is configured, 401 when the request does not carry it, 429 instead of 401
    when wrong tokens came too often lately from its address or from all
    (:class:`~halfserve.api.lockout.FailedAttempts`), answered only after the lockout's tarpit holds it
    (:class:`~halfserve.api.errors.HeldError`)."""
    check_admin(state(request), client_address(request), request.headers.get("authorization", ""))


# Management bodies ----------------------------------------------------------------------------------------------------

MANAGEMENT_BODY_BYTES = 64 * 2**10
"""Largest body of a management call (a load's parameters, a region's key): they are a few hundred bytes."""
MANAGEMENT_LIMIT = "a management call's limit"
"""How a refusal names :data:`MANAGEMENT_BODY_BYTES`."""


async def json_object(request: Request) -> dict[str, object]:
    """The request's JSON object body; an empty body is ``{}``, anything but an object a 400, one over
    ``MANAGEMENT_BODY_BYTES`` a 413."""
    raw = await read_body(request, MANAGEMENT_BODY_BYTES, MANAGEMENT_LIMIT)
    if not raw.strip():
        return {}
    payload = await parse_json(raw, MANAGEMENT_BODY_BYTES)
    if not isinstance(payload, dict):
        raise APIError(400, f"body: expected a JSON object, got {type(payload).__name__}")
    return payload
