"""The HTTP transport: its routes decode, validate and encode; tensors cross into the server as numpy arrays."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Protocol

from fastapi import FastAPI
from fastapi.routing import APIRoute
from starlette.datastructures import State
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Match, Route
from starlette.types import Receive, Scope, Send

from halfserve.api.errors import APIError
from halfserve.api.http import (
    docs,
    errors,
    guard,
    health,
    kserve_v1,
    management,
    monitoring,
    predict,
    shm,
    telemetry,
    torchserve,
    v2,
    v2_repository,
    v2_triton,
)
from halfserve.api.http.deps import MANAGEMENT_BODY_BYTES, MANAGEMENT_LIMIT, RELAYED_CLIENT, ROUTE_ONLY
from halfserve.api.http.errors import error_response
from halfserve.api.http.limits import scope_header, too_large_message
from halfserve.api.http.telemetry import REQUEST_ID_HEADER, scope_request_id
from halfserve.transport import Answer, DirectHandler

_ANSWERED_FIRST: dict[object, telemetry.Endpoint] = {
    predict.predict: predict.predict,
    v2.model_infer: v2.infer,
    torchserve.predictions: torchserve.predictions,
    kserve_v1.predict: kserve_v1.predict,
}
"""The inference routes' FastAPI endpoints, and the plain endpoints that answer in their place."""


def _hot_paths() -> list[Route]:
    methods: dict[tuple[str, telemetry.Endpoint], set[str]] = {}
    for r in (*predict.router.routes, *v2.router.routes, *torchserve.router.routes, *kserve_v1.router.routes):
        if isinstance(r, APIRoute) and r.endpoint in _ANSWERED_FIRST:
            methods.setdefault((r.path, _ANSWERED_FIRST[r.endpoint]), set()).update(r.methods or ())
    return [Route(path, run, methods=sorted(m), include_in_schema=False) for (path, run), m in methods.items()]


HOT_PATHS: list[Route] = _hot_paths()
"""The inference routes, each declared once (in its route module, for the OpenAPI schema) and answered here as a
plain Starlette route ahead of FastAPI: one route a path, with every method declared for it, so that a 405 there
allows them all (TorchServe's ``/predictions`` is declared once for ``POST`` and once for ``PUT``).

FastAPI's per-request dependency solving and nested-router matching cost about a third of the event loop's time
on a small model (profiled); the FastAPI declarations give the schema and answer nothing in practice.
"""

HOT_METHODS = ("POST", "PUT")
"""The methods of the inference routes: ``PUT`` for TorchServe's ``/predictions``, which ``curl -T`` sends."""


class App(FastAPI):
    """FastAPI, with the inference routes answered ahead of its middleware stack.

    Every request through FastAPI passes its middleware layers (server errors, exceptions, the async exit stack and
    the newer releases' body-limit and telemetry layers) before routing: measured here, a bare FastAPI ``/health``
    answered 4,100 req/s where the same route on bare Starlette answered 8,100. The inference routes handle their own
    errors (:func:`telemetry.metered` turns :class:`errors.APIError` and anything unexpected into JSON), so they are
    matched and run first; every other request, and the lifespan, go through FastAPI as usual.
    """

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            scope = head_as_get(scope)
            if _route_only(scope) and any(route.matches(scope)[0] is Match.FULL for route in self.router.routes):
                await Response(status_code=204, headers={ROUTE_ONLY.decode(): "routed"})(scope, receive, send)
                return
            if await answer_first(self, scope, receive, send):
                return
        await super().__call__(scope, receive, send)

    def direct_routes(self) -> Callable[[Scope], DirectHandler | None]:
        """This app's inference routes as the HTTP protocol answers them itself (:func:`direct_routes`)."""
        return direct_routes(self)


class _HasState(Protocol):
    state: State
    """Holds the app's :class:`~halfserve.serving.AppState` as ``serving``."""


def _route_only(scope: Scope) -> bool:
    """Whether a front-end asks only which route takes the request (:data:`~halfserve.api.http.deps.ROUTE_ONLY`):
    where none does, the router's answer is the same without the body it left behind."""
    return scope.get("client") is None and scope_header(scope, ROUTE_ONLY) is not None


def head_as_get(scope: Scope) -> Scope:
    """A HEAD request's scope as the GET it asks about, every other request's as it is. RFC 9110 section 9.3.2: a
    server answers HEAD wherever it answers GET, with GET's status and headers; the routes declare GET alone (FastAPI
    adds no HEAD), and uvicorn, which holds the request's own scope, sends no body for a HEAD. A copy, so that the
    request stays a HEAD to uvicorn."""
    return {**scope, "method": "GET"} if scope["method"] == "HEAD" else scope


def hot_route(scope: Scope) -> tuple[telemetry.Endpoint, dict[str, Any]] | None:
    """The inference endpoint that answers a POST with this ``scope`` (:data:`HOT_PATHS`, matched as Starlette
    matches them), and its path parameters; None for any other path."""
    for route in HOT_PATHS:
        match, child = route.matches(scope)
        if match is Match.FULL:
            return route.endpoint, child["path_params"]
    return None


def direct_routes(app: _HasState) -> Callable[[Scope], DirectHandler | None]:
    """The inference routes as the HTTP protocol answers them itself (:class:`halfserve.transport.DirectCycle`), for
    ``app``: for a POST's scope, its handler, None for every other path.

    What the protocol saves beside :func:`answer_first`: the ASGI app's layers (uvicorn's proxy-headers middleware,
    which touches only the client address and scheme, neither of which the inference routes read), the response's
    ASGI messages and uvicorn's checks of each header it sends (the inference routes write only their own).
    """

    def route(scope: Scope) -> DirectHandler | None:
        found = hot_route(scope)
        if found is None:
            return None
        return functools.partial(_answer_direct, app, *found)

    return route


async def _answer_direct(
    app: _HasState, endpoint: telemetry.Endpoint, params: dict[str, Any], scope: Scope, receive: Receive
) -> Answer:
    try:
        guard.check(scope, app.state.serving.settings)
    except APIError as e:
        return error_response(e.status, e.message, e.headers)
    return await _run(app, endpoint, params, scope, receive)


async def answer_first(app: _HasState, scope: Scope, receive: Receive, send: Send) -> bool:
    """Answer an HTTP request ahead of any other routing, as ``app``, when it is refused by :mod:`guard` or is an
    inference request (:data:`HOT_PATHS`); False when it is neither, for the caller's own routing to answer.

    The one way in for everything that serves HTTP: :class:`App` itself and the ``--http-workers`` front-ends.
    ``app.state.serving`` is what the endpoints read (:class:`~halfserve.serving.AppState`).
    """
    if not await guard.admitted(scope, receive, send, app.state.serving.settings):
        return True
    found = hot_route(scope) if scope["method"] in HOT_METHODS else None
    if found is None:
        return False
    response = await _run(app, *found, scope, receive)
    await response(scope, receive, send)
    return True


async def _run(
    app: _HasState, endpoint: telemetry.Endpoint, params: dict[str, Any], scope: Scope, receive: Receive
) -> Response:
    """Run an inference endpoint as ``app``, with its path parameters, and return its response.

    The endpoint is called directly rather than through ``Route.handle``, whose request/response wrapper and
    exception-handler lookup cost about a tenth of the event loop's time per request on a small model (profiled).
    Its errors need no handler here: :func:`telemetry.metered` answers them as the API's JSON, with the request id.
    """
    scope["app"] = app
    scope["path_params"] = params
    scope["endpoint"] = endpoint
    return await endpoint(Request(scope, receive))


def install(app: FastAPI) -> None:
    """Add every route, the JSON error handlers and request ids to ``app``."""
    errors.install(app, torchserve.ROUTING_SHAPES | kserve_v1.ROUTING_SHAPES)
    # A path with a trailing slash is not found, as on TorchServe's management port: Starlette's redirect answered
    # 307 with an empty body and a Location built from the client's Host header. The --http-workers front-ends relay
    # every such path here.
    app.router.redirect_slashes = False
    app.add_middleware(telemetry.RequestIdMiddleware)
    # v2_triton ahead of v2: its /v2/models/stats must match before v2's /v2/models/{model_name}.
    routers = [
        predict.router,
        torchserve.router,
        health.router,
        management.router,
        monitoring.router,
        v2_triton.router,
        shm.router,
        kserve_v1.router,
    ]
    if app.state.serving.settings.docs:
        routers.append(docs.router)
    for router in (*routers, v2_repository.router, v2.router):
        # Added flat rather than with include_router, which matches through an extra router layer per request.
        app.router.routes.extend(router.routes)
    app.router.routes[:0] = HOT_PATHS


__all__ = [
    "MANAGEMENT_BODY_BYTES",
    "MANAGEMENT_LIMIT",
    "RELAYED_CLIENT",
    "REQUEST_ID_HEADER",
    "ROUTE_ONLY",
    "App",
    "answer_first",
    "direct_routes",
    "error_response",
    "head_as_get",
    "install",
    "scope_header",
    "scope_request_id",
    "too_large_message",
]
