"""JSON error responses: every 4xx/5xx body is ``{"error": "<what went wrong, naming the field>"}``; their OpenAPI
entries, and FastAPI's own errors answered in the same shape."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response
from starlette.types import Scope

from halfserve.api.errors import APIError, forget, from_exception, held
from halfserve.errors import ServingError


def error_response(status: int, message: str, headers: dict[str, str] | None = None) -> Response:
    return Response(
        orjson.dumps({"error": message}), status_code=status, media_type="application/json", headers=headers
    )


ERROR_BODY: dict[str, Any] = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {"type": "string", "description": "What went wrong, naming the field or setting."}},
}

_HEADERS: dict[int, dict[str, Any]] = {
    401: {"WWW-Authenticate": {"schema": {"type": "string"}, "description": "Bearer"}},
    429: {"Retry-After": {"schema": {"type": "string"}, "description": "Seconds until the address may try again."}},
    503: {"Retry-After": {"schema": {"type": "string"}, "description": "Seconds to wait (queue full, loading)."}},
}


Responses = dict[int | str, dict[str, Any]]
"""OpenAPI ``responses`` entries by status, as FastAPI's route decorators take them."""


def as_json(value: object) -> str:
    """A value from a request body, as a refusal quotes it: in the JSON the client wrote (``true``, ``null``), not in
    Python's words (``True``); cut to 200 characters."""
    try:
        return orjson.dumps(value).decode()[:200]
    except TypeError:  # an integer past 64 bits
        return repr(value)[:200]


def error_responses(descriptions: dict[int, str]) -> Responses:
    """OpenAPI ``responses`` entries for error statuses, each with the ``{"error": ...}`` body."""
    responses: Responses = {}
    for status, description in descriptions.items():
        entry: dict[str, Any] = {
            "description": description,
            "content": {"application/json": {"schema": ERROR_BODY}},
        }
        if status in _HEADERS:
            entry["headers"] = _HEADERS[status]
        responses[str(status)] = entry
    return responses


def json_ok(description: str, schema: dict[str, Any] | None = None) -> Responses:
    """The OpenAPI ``responses`` entry of a 200 with a JSON body described by ``schema``."""
    return {"200": {"description": description, "content": {"application/json": {"schema": schema or {}}}}}


REQUEST_ID = "halfserve.request_id"
"""The scope key of a request's id, as the request id layer (:class:`~halfserve.api.http.telemetry.RequestIdMiddleware`)
chose it."""
RoutingShape = Callable[[int, dict[str, str] | None, Scope], Response | None]
"""An API's own answer to the router's 404 or 405 (the status, the headers the router gave, ``Allow``, and the
request's scope), or None for the server's own."""


def install(app: FastAPI, shapes: Mapping[str, RoutingShape] | None = None) -> None:
    """Make FastAPI's own errors (404, 405, validation) speak the same JSON shape; a router 404 or 405 on a path
    that starts with a prefix of ``shapes`` in that API's own (TorchServe's on ``/predictions/``)."""
    shaped = dict(shapes or {})

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        headers = dict(exc.headers) if exc.headers else None
        if headers is not None and "Allow" in headers:
            # A GET route answers HEAD too (halfserve.api.http.head_as_get), which its declaration does not name; and
            # Starlette keeps a route's methods in a set, so their order had changed from one start to the next.
            methods = set(headers["Allow"].split(", "))
            headers["Allow"] = ", ".join(sorted(methods | {"HEAD"} if "GET" in methods else methods))
        if exc.status_code in (404, 405):
            path = request.scope["path"]
            for prefix, shape in shaped.items():
                if path.startswith(prefix) or path == prefix.rstrip("/"):  # "/predictions" as "/predictions/"
                    answer = shape(exc.status_code, headers, request.scope)
                    if answer is not None:
                        return answer
        return error_response(exc.status_code, str(exc.detail), headers)

    async def validation_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        parts = []
        for err in exc.errors():
            field = ".".join(str(x) for x in err.get("loc", ()) if x != "body") or "body"
            parts.append(f"{field}: {err.get('msg', 'invalid')}")
        return error_response(400, "; ".join(parts))

    async def api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, (APIError, ServingError))
        await held(exc)
        err = from_exception(exc)
        forget(exc)
        return error_response(err.status, err.message, err.headers)

    async def unexpected(request: Request, exc: Exception) -> Response:
        # Starlette's last resort answers this and still raises the exception on, for the server's log (a route that
        # failed on something unforeseen, such as the process's open files running out, had answered plain text).
        rid = request.scope.get(REQUEST_ID)  # answered outside the layer that adds it
        headers = {"X-Request-Id": rid.decode()} if isinstance(rid, bytes) else None
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}", headers)

    app.add_exception_handler(Exception, unexpected)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(ServingError, api_error)
