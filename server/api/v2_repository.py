"""The V2 model repository extension: list the store's models, load and unload them without a restart.

These are management calls. They answer only with ``Authorization: Bearer <admin token>`` (401 otherwise), and
only when the server has an admin token at all (403 otherwise), so a server started without one cannot be
reconfigured over HTTP.
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import Enum
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from server import manifest as store
from server.api.deps import (
    AUTH_ERRORS,
    BEARER,
    OPTIONAL_JSON_BODY,
    json_object,
    json_response,
    repository,
    require_admin,
)
from server.api.errors import APIError, error_responses, from_exception, json_ok
from server.manifest import Precision, StoreError
from server.repository import ModelRepository, ServedModel
from server.serving import ModelState

router = APIRouter()

_ENTRY: dict[str, Any] = {"type": "object", "required": ["name", "state"]}


class RepositoryState(str, Enum):
    """A model's state as the repository extension names it."""

    READY = "READY"
    LOADING = "LOADING"
    UNAVAILABLE = "UNAVAILABLE"


def index_entry(served: ServedModel) -> dict[str, object]:
    """One model of the repository index: name, version, state and, unless ready, the reason."""
    if served.state is ModelState.READY:
        state, reason = RepositoryState.READY, ""
    elif served.state is ModelState.LOADING:
        state, reason = RepositoryState.LOADING, "loading"
    else:
        state, reason = RepositoryState.UNAVAILABLE, served.error or served.state.value
    return {"name": served.name, "version": str(served.version), "state": state.value, "reason": reason}


def refuse_overrides(parameters: Iterable[str]) -> None:
    """A 400 naming a load's parameters that would override the model's configuration (``config``, ``file:...``),
    which is not supported."""
    overrides = sorted(k for k in parameters if k == "config" or k.startswith("file:"))
    if overrides:
        raise APIError(400, f"parameters: {', '.join(overrides)}: overriding a model's configuration is not supported")


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
    return json_response(index_entries(repository(request), ready_only))


def index_entries(repo: ModelRepository, ready_only: bool) -> list[dict[str, object]]:
    """The repository index, by name: the served models, then the store's others as not loaded."""
    entries = [index_entry(m) for m in repo.models.values()]
    try:
        others = [n for n in store.model_names(repo.settings.store) if n not in repo.models]
    except StoreError:
        others = []
    entries += [{"name": n, "state": RepositoryState.UNAVAILABLE.value, "reason": "not loaded"} for n in others]
    if ready_only:
        entries = [e for e in entries if e["state"] == RepositoryState.READY.value]
    return sorted(entries, key=lambda e: str(e["name"]))


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
    refuse_overrides(params)
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
