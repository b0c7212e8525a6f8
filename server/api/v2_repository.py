"""The V2 model repository extension: list the store's models, load and unload them without a restart.

These are management calls. They answer only with ``Authorization: Bearer <admin token>`` (401 otherwise), and
only when the server has an admin token at all (403 otherwise), so a server started without one cannot be
reconfigured over HTTP.
"""

from __future__ import annotations

import math
import secrets
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from enum import Enum
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.security import HTTPBearer
from starlette.responses import Response

from server import store
from server.api.errors import APIError, error_responses, from_exception, json_ok
from server.api.limits import parse_json, raw_header, read_body
from server.api.models import json_response
from server.api.predict import repository
from server.precision import Precision
from server.repository import ModelRepository, ModelState, ServedModel
from server.settings import Settings
from server.store import StoreError

router = APIRouter()

_ENTRY: dict[str, Any] = {"type": "object", "required": ["name", "state"]}
AUTH_ERRORS = error_responses(
    {
        400: "Malformed body.",
        401: "The Authorization: Bearer token is missing or wrong.",
        403: "The management API is off: the server has no admin token.",
        413: "A body over 64 KiB.",
        429: "Too many wrong tokens from this address lately (Retry-After).",
    }
)
OPTIONAL_JSON_BODY: dict[str, Any] = {
    "requestBody": {"required": False, "content": {"application/json": {"schema": {"type": "object"}}}},
}
# Declares the bearer scheme in the OpenAPI schema; the check itself is require_admin's (403 when no token is set).
BEARER = [Depends(HTTPBearer(auto_error=False))]


class RepositoryState(str, Enum):
    """A model's state as the repository extension names it."""

    READY = "READY"
    LOADING = "LOADING"
    UNAVAILABLE = "UNAVAILABLE"


class FailedAttempts:
    """Wrong admin tokens per client address. Past ``limit`` in ``window`` seconds an address is refused (429)
    without its token being checked, until its oldest failure leaves the window: guessing costs minutes per ten tries.
    At most ``addresses`` are remembered (the longest quiet ones are forgotten first), so the table stays small."""

    def __init__(
        self, limit: int = 10, window: float = 60.0, addresses: int = 4096, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.limit, self.window, self.addresses, self.clock = limit, window, addresses, clock
        self.failures: OrderedDict[str, deque[float]] = OrderedDict()

    def retry_after(self, who: str) -> float:
        """Seconds until ``who`` may try again; 0 when it may now."""
        times = self.failures.get(who)
        if times is None:
            return 0.0
        now = self.clock()
        while times and times[0] <= now - self.window:
            times.popleft()
        if not times:
            del self.failures[who]
            return 0.0
        return times[0] + self.window - now if len(times) >= self.limit else 0.0

    def failed(self, who: str) -> None:
        times = self.failures.setdefault(who, deque())
        times.append(self.clock())
        self.failures.move_to_end(who)
        if len(self.failures) > self.addresses:
            self.failures.popitem(last=False)


RELAYED_CLIENT = b"x-halfserve-relayed-client"
"""The client's address on a request a front-end relays (``--http-workers``), which reaches this process over a Unix
socket that has no client address; a front-end drops the header from what clients send."""


def client_address(request: Request) -> str:
    """The address a request came from: its connection's, or on a relayed request the one the front-end saw."""
    if request.client is not None:
        return request.client.host
    return (raw_header(request, RELAYED_CLIENT) or b"").decode("latin-1")


def require_admin(request: Request) -> None:
    """Fail with 403 when no admin token is configured, 401 when the request does not carry it, 429 when its address
    got the token wrong too often lately (:class:`FailedAttempts`)."""
    settings: Settings = request.app.state.settings
    if settings.admin_token is None:
        raise APIError(403, "management API is disabled; set HALFSERVE_ADMIN_TOKEN")
    attempts: FailedAttempts | None = getattr(request.app.state, "failed_admin_attempts", None)
    if attempts is None:
        attempts = request.app.state.failed_admin_attempts = FailedAttempts()
    who = client_address(request)
    wait = attempts.retry_after(who)
    if wait > 0:
        seconds = str(math.ceil(wait))
        raise APIError(429, f"too many wrong admin tokens from {who}; retry in {seconds} s", {"Retry-After": seconds})
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not given.strip():
        raise APIError(401, "management call needs Authorization: Bearer <admin token>", {"WWW-Authenticate": "Bearer"})
    expected = settings.admin_token.get_secret_value().encode()
    if not secrets.compare_digest(given.strip().encode(), expected):
        attempts.failed(who)
        raise APIError(401, "wrong admin token", {"WWW-Authenticate": 'Bearer error="invalid_token"'})


def index_entry(served: ServedModel) -> dict[str, object]:
    """One model of the repository index: name, version, state and, unless ready, the reason."""
    if served.state is ModelState.READY:
        state, reason = RepositoryState.READY, ""
    elif served.state is ModelState.LOADING:
        state, reason = RepositoryState.LOADING, "loading"
    else:
        state, reason = RepositoryState.UNAVAILABLE, served.error or served.state.value
    return {"name": served.name, "version": str(served.version), "state": state.value, "reason": reason}


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


async def load_from_store(
    repo: ModelRepository, name: str, version: int | None = None, precision: Precision | None = None
) -> ServedModel:
    """Load ``name`` from the store: a 400 for an invalid name or a checkpoint that fails, a 404 when the store
    has no such model or version."""
    try:
        store.check_name(name)
    except StoreError as e:
        raise APIError(400, str(e)) from None
    model_dir = repo.settings.store / name
    if not (model_dir / store.MANIFEST).is_file():
        raise APIError(404, f"model {name!r} is not in the store")
    if version is not None and version not in store.versions(model_dir):
        raise APIError(404, f"model {name!r} has no version {version} in the store")
    try:
        return await repo.load(name, version, precision)
    except StoreError as e:
        raise APIError(400, f"failed to load {name!r}: {e}") from None
    except Exception as e:
        raise from_exception(e) from None


@router.post(
    "/v2/repository/index",
    response_class=Response,
    responses={**json_ok("The models of the store.", {"type": "array"}), **AUTH_ERRORS},
    openapi_extra=OPTIONAL_JSON_BODY,
    dependencies=BEARER,
)
async def repository_index(request: Request) -> Response:
    """Every model in the store: served ones with their version and state, the others as ``UNAVAILABLE`` ("not
    loaded"). With ``{"ready": true}``, only the ready ones."""
    require_admin(request)
    ready_only = (await json_object(request)).get("ready", False)
    if not isinstance(ready_only, bool):
        raise APIError(400, f"ready: expected true or false, got {ready_only!r}")
    repo = repository(request)
    entries = [index_entry(m) for m in repo.models.values()]
    try:
        others = [n for n in store.model_names(repo.settings.store) if n not in repo.models]
    except StoreError:
        others = []
    entries += [{"name": n, "state": RepositoryState.UNAVAILABLE.value, "reason": "not loaded"} for n in others]
    if ready_only:
        entries = [e for e in entries if e["state"] == RepositoryState.READY.value]
    return json_response(sorted(entries, key=lambda e: str(e["name"])))


@router.post(
    "/v2/repository/models/{model_name}/load",
    response_class=Response,
    responses={
        **json_ok("Loaded and ready.", _ENTRY),
        **AUTH_ERRORS,
        **error_responses(
            {
                400: "Malformed body, an invalid model name, a configuration override, or a checkpoint that fails.",
                404: "No such model in the store.",
            }
        ),
    },
    openapi_extra=OPTIONAL_JSON_BODY,
    dependencies=BEARER,
)
async def load_model(model_name: str, request: Request) -> Response:
    """Load (or reload) a model from the store: the served version is read again, and a loaded model keeps
    answering from its old instance until the new one is warm. Overriding the configuration is not supported."""
    require_admin(request)
    params = (await json_object(request)).get("parameters") or {}
    if not isinstance(params, dict):
        raise APIError(400, f"parameters: expected an object, got {type(params).__name__}")
    overrides = sorted(k for k in params if k == "config" or k.startswith("file:"))
    if overrides:
        raise APIError(400, f"parameters: {', '.join(overrides)}: overriding a model's configuration is not supported")
    served = await load_from_store(repository(request), model_name)
    return json_response(index_entry(served))


@router.post(
    "/v2/repository/models/{model_name}/unload",
    response_class=Response,
    responses={
        **json_ok("Unloaded.", _ENTRY),
        **AUTH_ERRORS,
        **error_responses({400: "Malformed body.", 404: "No such model is served."}),
    },
    openapi_extra=OPTIONAL_JSON_BODY,
    dependencies=BEARER,
)
async def unload_model(model_name: str, request: Request) -> Response:
    """Stop serving a model: requests already queued are answered, then its engine is released."""
    require_admin(request)
    await json_object(request)  # validated; unload_dependents has no meaning here (models have no dependents)
    repo = repository(request)
    try:
        await repo.unload(model_name)
        served = repo.get(model_name)
    except Exception as e:
        raise from_exception(e) from None
    return json_response(index_entry(served))
