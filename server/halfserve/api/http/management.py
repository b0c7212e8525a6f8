"""The management API: load, unload and reload a model or a version, and switch its precision, without a restart.

``GET /models`` lists what is served. The calls here change it, and like the V2 repository extension they answer only
with ``Authorization: Bearer <admin token>`` (see :func:`~halfserve.api.http.deps.require_admin`). Each answers with
the model's listing once the change is done: a load or reload returns when the new instance is warm and serving, a
precision switch when the new engine serves and the old one has answered its last batch.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from halfserve.api.admin import load_from_store
from halfserve.api.errors import APIError, from_exception
from halfserve.api.http.deps import AUTH_ERRORS, BEARER, json_object, json_response, repository, require_admin
from halfserve.api.http.errors import as_json, error_responses, json_ok
from halfserve.errors import ModelNotFoundError, ModelNotReadyError
from halfserve.manifest import Precision
from halfserve.storage import StoreError

router = APIRouter()

_PRECISIONS = [p.value for p in Precision]
_LISTING = json_ok("The model's listing after the change, as in GET /models.", {"type": "object", "required": ["name"]})


def _body_schema(properties: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "object", "properties": properties}
    if required:
        schema["required"] = required
    return {
        "requestBody": {"required": bool(required), "content": {"application/json": {"schema": schema}}},
    }


_VERSION = {"type": "integer", "minimum": 1, "description": "Defaults to the store's (the pinned or highest)."}
_PRECISION = {"type": "string", "enum": _PRECISIONS, "description": "Served from now on, across reloads."}


def _precision(body: dict[str, object], required: bool = False) -> Precision | None:
    value = body.get("precision")
    if value is None and not required:
        return None
    if not isinstance(value, str) or value not in _PRECISIONS:
        raise APIError(400, f"precision: expected one of {', '.join(_PRECISIONS)}, got {value!r}")
    return Precision(value)


async def _body(request: Request, *known: str) -> dict[str, object]:
    """The call's JSON object body, holding only the ``known`` keys: a misspelt key (``"precison"``) would otherwise
    be ignored and the call done as if it were not there."""
    body = await json_object(request)
    unknown = [k for k in body if k not in known]
    if unknown:
        keys = ", ".join(map(repr, unknown))
        takes = " and ".join(map(repr, known)) if known else "none"
        raise APIError(400, f"body: unknown key {keys}; this call takes {takes}")
    return body


def _version(body: dict[str, object]) -> int | None:
    value = body.get("version")
    if value is None:
        return None
    if isinstance(value, str) and value.isascii() and value.isdigit() and not value.startswith("0"):
        # V2 spells versions as strings: ASCII digits, as folders are named ("١" is no version, nor "01", which V2's
        # and TorchServe's routes take for an unknown version)
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise APIError(400, f"version: expected a positive integer, got {as_json(value)}")
    return value


@router.post(
    "/models/{name}/load",
    response_class=Response,
    responses={
        **_LISTING,
        **AUTH_ERRORS,
        **error_responses(
            {400: "Malformed body, invalid name, or a checkpoint that fails.", 404: "No such model or version."}
        ),
    },
    openapi_extra=_body_schema({"version": _VERSION, "precision": _PRECISION}),
    dependencies=BEARER,
)
async def load(name: str, request: Request) -> Response:
    """Load a model (or another version of it) from the store, warmed up before it serves. A model being served
    answers from its old instance until the new one is ready; one that is not shows as loading meanwhile."""
    require_admin(request)
    body = await _body(request, "version", "precision")
    served = await load_from_store(repository(request), name, _version(body), _precision(body))
    return json_response(served.describe())


@router.post(
    "/models/{name}/reload",
    response_class=Response,
    responses={
        **_LISTING,
        **AUTH_ERRORS,
        **error_responses({400: "Malformed body, or a checkpoint that fails.", 404: "No such model is known."}),
    },
    openapi_extra=_body_schema({"precision": _PRECISION}),
    dependencies=BEARER,
)
async def reload(name: str, request: Request) -> Response:
    """Read the version a model serves (or last served) again from the store, e.g. after its file was replaced."""
    require_admin(request)
    body = await _body(request, "precision")
    repo = repository(request)
    try:
        version = repo.get(name).version
    except ModelNotFoundError as e:
        raise APIError(404, str(e)) from None
    served = await load_from_store(repo, name, version, _precision(body))
    return json_response(served.describe())


@router.post(
    "/models/{name}/unload",
    response_class=Response,
    responses={**_LISTING, **AUTH_ERRORS, **error_responses({400: "Malformed body.", 404: "No such model is known."})},
    dependencies=BEARER,
)
async def unload(name: str, request: Request) -> Response:
    """Stop serving a model: requests already queued are answered, then its engine is released."""
    require_admin(request)
    await _body(request)  # a body, if any, of no keys: one given had been ignored
    repo = repository(request)
    try:
        await repo.unload(name)
        return json_response(repo.get(name).describe())
    except Exception as e:
        raise from_exception(e) from None


@router.post(
    "/models/{name}/precision",
    response_class=Response,
    responses={
        **_LISTING,
        **AUTH_ERRORS,
        **error_responses(
            {
                400: "Malformed body or unknown precision, or the new engine failed to load (the old one serves on).",
                404: "No such model.",
                409: "The model is not being served.",
            }
        ),
    },
    openapi_extra=_body_schema({"precision": _PRECISION}, required=["precision"]),
    dependencies=BEARER,
)
async def set_precision(name: str, request: Request) -> Response:
    """Serve a model in another precision (``fp32`` is the fallback switch) without re-reading its checkpoint: the
    new engine is cast from the fp32 weights kept on the host and warmed up while the old one serves, and no
    request fails over the switch."""
    require_admin(request)
    precision = _precision(await _body(request, "precision"), required=True)
    assert precision is not None
    repo = repository(request)
    try:
        served = await repo.set_precision(name, precision)
    except ModelNotReadyError as e:
        raise APIError(409, str(e)) from None
    except StoreError as e:  # the new engine did not start: the old one serves on
        serving = repo.get(name).precision
        still = f"; it goes on serving in {serving.value}" if serving is not None else ""
        raise APIError(400, f"failed to load {name!r} in {precision.value}: {e}{still}") from None
    except Exception as e:
        raise from_exception(e) from None
    return json_response(served.describe())
