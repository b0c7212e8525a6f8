"""What the inference routes record per request: a request id, metrics, and access and error log lines.

Done by a wrapper around the two inference endpoints rather than by an HTTP middleware, which would run on every
request and cost more than the whole of this (a Starlette middleware adds tens of microseconds; this adds a few).
The endpoint names the model and the precision that served the request with :func:`note` and :func:`answered`; the
wrapper turns errors into their JSON answers itself, so that they too carry the request id and are counted.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import re
import time
from collections.abc import Awaitable, Callable

from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from halfserve.api.errors import APIError, forget, from_exception, held
from halfserve.api.http.errors import REQUEST_ID, error_response
from halfserve.api.http.limits import raw_header
from halfserve.errors import InternalError, ServingError
from halfserve.logs import ACCESS_LOGGER
from halfserve.metrics import request_labels
from halfserve.serving import AppState, Interface, ModelHandle, Prediction
from halfserve.transport import BODY_TIMED_OUT

log = logging.getLogger(ACCESS_LOGGER)
"""One line per inference request at INFO when access logging is on (see :func:`halfserve.logs.configure`); failures
(5xx) at WARNING whatever the setting."""

REQUEST_ID_HEADER = "X-Request-Id"
_REQUEST_ID_KEY = REQUEST_ID_HEADER.lower().encode()
_REQUEST_ID = re.compile(rb"[A-Za-z0-9._:-]{1,128}")
"""A client's id is logged as given: no spaces or ``=`` that could forge fields of a text log line."""
_SERVED = "halfserve.served"
_ANSWERED = "halfserve.answered"

# A random per-process prefix and a counter: unique across replicas and restarts, and far cheaper than a uuid4.
_PREFIX = os.urandom(6).hex()
_sequence = itertools.count(1)

Endpoint = Callable[[Request], Awaitable[Response]]


def request_id(request: Request) -> bytes:
    """The client's ``X-Request-Id`` when it is a sane one (1-128 of ``A-Z a-z 0-9 . _ : -``), else a new id."""
    return _sane_or_new(raw_header(request, _REQUEST_ID_KEY))


def scope_request_id(scope: Scope) -> bytes:
    """The id of the request ``scope`` carries, as :class:`RequestIdMiddleware` gives it: for an answer made ahead of
    that layer (a front-end's own refusal)."""
    return _sane_or_new(next((bytes(v) for k, v in scope["headers"] if k == _REQUEST_ID_KEY), None))


def _sane_or_new(given: bytes | None) -> bytes:
    if given is not None and _REQUEST_ID.fullmatch(given):
        return given
    return f"{_PREFIX}-{next(_sequence):x}".encode()


class RequestIdMiddleware:
    """``X-Request-Id`` in and out on every other route (health, listings, metrics, management, errors).

    The inference routes are answered ahead of the middleware stack and set the header themselves (:func:`metered`);
    this pure ASGI layer costs the other routes a header scan and one list append.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = scope_request_id(scope)
        scope[REQUEST_ID] = rid  # for an answer made outside this layer (errors.install's last resort)

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), (_REQUEST_ID_KEY, rid)]
            await send(message)

        await self.app(scope, receive, send_with_id)


def note(request: Request, served: ModelHandle) -> None:
    """Name the model a request is for, once known, so its metrics and log line carry it even if it fails."""
    request.scope[_SERVED] = served


def answered(request: Request, prediction: Prediction) -> None:
    """Record the outputs a request is answered with (their rows and the precision that computed them)."""
    request.scope[_ANSWERED] = prediction


def metered(interface: Interface) -> Callable[[Endpoint], Endpoint]:
    """Wrap an inference endpoint: request id in and out, errors answered as JSON, the request counted."""

    def wrap(endpoint: Endpoint) -> Endpoint:
        @functools.wraps(endpoint)
        async def metered_endpoint(request: Request) -> Response:
            start = time.perf_counter()
            rid = request_id(request)
            try:
                response = await endpoint(request)
            except APIError as e:
                await held(e)
                response = error_response(e.status, e.message, e.headers)
                forget(e)
            except (ServingError, InternalError) as e:  # raised below the routes: the status it maps onto
                err = from_exception(e)
                response = error_response(err.status, err.message, err.headers)
                forget(e)
            except ClientDisconnect:
                # The client went away before its body arrived (499, nginx's "client closed request"), or let it
                # stall past the body timeout (408, already answered by the protocol): nothing to answer now, and
                # not the server's fault, so no 500 and no traceback.
                if request.scope.get(BODY_TIMED_OUT):
                    response = error_response(408, "body: stalled past the body timeout (body_timeout)")
                else:
                    response = error_response(499, "client closed the connection before the request body arrived")
            except Exception as e:  # what Starlette's error middleware would answer, in the API's JSON shape
                log.exception("unhandled error in %s", request.url.path, extra={"request_id": rid.decode()})
                response = error_response(500, f"internal error: {type(e).__name__}: {e}")
            response.raw_headers.append((_REQUEST_ID_KEY, rid))
            _record(request, interface, response.status_code, rid, time.perf_counter() - start)
            return response

        return metered_endpoint

    return wrap


def _record(request: Request, interface: Interface, status: int, rid: bytes, seconds: float) -> None:
    scope = request.scope
    model, precision, rows = request_labels(scope.get(_SERVED), scope.get(_ANSWERED))
    app: AppState = scope["app"].state.serving
    metrics = app.metrics
    if metrics is not None:
        metrics.request(model, precision, interface, status, rows, seconds)
    level = logging.WARNING if status >= 500 else logging.INFO
    if log.isEnabledFor(level):
        log.log(
            level,
            "%s %s %d %.2fms model=%s precision=%s rows=%d request_id=%s",
            request.method,
            request.url.path,
            status,
            seconds * 1000,
            model,
            precision,
            rows,
            rid.decode(),
            extra={
                "request_id": rid.decode(),
                "method": request.method,
                "path": request.url.path,
                "status": status,
                "duration_ms": round(seconds * 1000, 3),
                "model": model,
                "precision": precision,
                "protocol": interface.value,
                "rows": rows,
            },
        )
