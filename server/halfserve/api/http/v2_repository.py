"""The V2 model repository extension: list the store's models, load and unload them without a restart.

These are management calls. They answer only with ``Authorization: Bearer <admin token>`` (401 otherwise), and
only when the server has an admin token at all (403 otherwise), so a server started without one cannot be
reconfigured over HTTP.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from halfserve.api.admin import index_entries, index_entry, load_from_store, refuse_overrides
from halfserve.api.errors import APIError, from_exception
from halfserve.api.http.deps import (
    AUTH_ERRORS,
    BEARER,
    OPTIONAL_JSON_BODY,
    json_object,
    json_response,
    repository,
    require_admin,
)
from halfserve.api.http.errors import error_responses, json_ok

router = APIRouter()

_ENTRY: dict[str, Any] = {"type": "object", "required": ["name", "state"]}


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
    params = (await json_object(request)).get("parameters")
    params = {} if params is None else params
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
