"""TorchServe's inference API: ``POST`` (or ``PUT``) ``/predictions/{model}[/{version}]`` with a photo as the body
(``curl -T kitten.jpg``, ``--data-binary @kitten.jpg``) or photos in a form (``-F data=@kitten.jpg``, fields named
``data`` or ``body``, one image each), answered as TorchServe's ``image_classifier`` handler answers: a model with
labels gives its top five classes after softmax, highest first, as ``{"label": probability}``; one without, its
output as a list; one whose manifest declares an ``answer``, as TorchServe's ``object_detector`` or
``image_segmenter`` answers (:mod:`halfserve.answershapes`). Several images in one form: a list, one answer per image.
And ``GET /ping``, its health check.

Errors carry TorchServe's ``code``, ``type`` and ``message``, which its clients read, and this server's ``error``
(the same message), which every other route answers: a client of either reads them unchanged.
"""

from __future__ import annotations

import functools
import re
from typing import Any

import orjson
from fastapi import APIRouter, Request
from starlette.responses import Response
from starlette.types import Scope

from halfserve.api.access import check_taken
from halfserve.api.dataplane import handled
from halfserve.api.dataplane.infer import infer
from halfserve.api.dataplane.photos import decode_photos, image_count
from halfserve.api.dataplane.stockanswers import stock_answers
from halfserve.api.errors import APIError
from halfserve.api.http import deps, multipart
from halfserve.api.http.errors import RoutingShape, error_responses, json_ok
from halfserve.api.http.limits import TIMEOUT_PARAMETER, client_timeout, raw_header, read_body
from halfserve.api.http.telemetry import Endpoint, answered, metered, note
from halfserve.serving import Interface, ModelHandle

router = APIRouter()

FIELDS = ("data", "body")
"""The form fields TorchServe's handlers read an image from."""
ERROR_TYPES = {
    400: "BadRequestException",
    404: "ModelNotFoundException",
    408: "RequestTimeoutException",
    413: "RequestTooLargeException",
    500: "InternalServerException",
    503: "ServiceUnavailableException",
    504: "RequestTimeoutException",
}
"""The ``type`` of an error by its status: TorchServe's own exception names for 400, 404, 408, 500 and 503, and names
in their style for the statuses it has no exception of its own for."""
NOT_FOUND_MESSAGE = "Requested resource is not found, please refer to API document."
"""TorchServe's answer to a path it has no route for."""
NOT_ALLOWED_MESSAGE = "Requested method is not allowed, please refer to API document."
"""TorchServe's answer to a method a path has no route for."""
_VERSION = re.compile(r"(0|[1-9][0-9]{0,8})\.0", re.ASCII)
"""A version as TorchServe's archives spell it (``2.0``), in ASCII digits."""

_IMAGE_BODY = {"schema": {"type": "string", "format": "binary"}}
PREDICTIONS_SCHEMA: dict[str, Any] = {
    "parameters": [TIMEOUT_PARAMETER],
    "requestBody": {
        "required": True,
        "description": "One JPEG, PNG or WebP image as the body, or images in form fields named data or body.",
        "content": {
            "image/jpeg": _IMAGE_BODY,
            "image/png": _IMAGE_BODY,
            "image/webp": _IMAGE_BODY,
            "application/octet-stream": _IMAGE_BODY,
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "properties": {"data": {"type": "string", "format": "binary"}},
                }
            },
        },
    },
    "responses": {
        **json_ok(
            "The top classes after softmax, highest first, as {label: probability} (a model with labels); "
            'detections as [{label: [x1, y1, x2, y2], "score": s}] or each pixel\'s [class, probability] (a model '
            "with an answer section); else the output as a list; a list of those for several images.",
            {"anyOf": [{"type": "object"}, {"type": "array"}]},
        ),
        **error_responses(
            {
                400: "Not an image the server takes (JPEG, PNG, WebP), a broken file, or a model without images.",
                404: "Unknown model, or a version it does not serve.",
                413: "Body, images per request or pixels per image over the limits.",
                503: "Queue full, model not loaded, or too many requests waiting to be decoded (with Retry-After).",
                504: "The request's deadline passed before its rows had all started.",
            }
        ),
    },
}


def error(status: int, message: str, kind: str | None = None, headers: dict[str, str] | None = None) -> Response:
    """An error in TorchServe's shape (``code``, ``type``, ``message``), with this server's ``error`` too."""
    kind = kind or ERROR_TYPES.get(status, "InternalServerException" if status >= 500 else "BadRequestException")
    body = {"code": status, "type": kind, "message": message, "error": message}
    return Response(orjson.dumps(body), status_code=status, media_type="application/json", headers=headers)


def routing_error(status: int, headers: dict[str, str] | None, scope: Scope) -> Response:
    """The router's 404 or 405 on TorchServe's inference paths, as TorchServe answers them (its clients read
    ``type``), with the ``Allow`` the router named."""
    if status == 405:
        return error(405, NOT_ALLOWED_MESSAGE, "MethodNotAllowedException", headers)
    return error(status, NOT_FOUND_MESSAGE, "ResourceNotFoundException", headers)


ROUTING_SHAPES: dict[str, RoutingShape] = {"/predictions/": routing_error, "/explanations/": routing_error}
"""The path prefixes whose routing errors answer in TorchServe's shape (:func:`halfserve.api.http.errors.install`)."""


def version_named(asked: str) -> str:
    """``asked`` as this server spells a version: ``2.0``, as TorchServe's archives spell it, is ``2``; any other is
    as it is (the management API takes the same two spellings)."""
    return asked[:-2] if _VERSION.fullmatch(asked) else asked


def torchserve_errors(endpoint: Endpoint) -> Endpoint:
    """Answer ``endpoint``'s errors (already this server's ``{"error": ...}``) with TorchServe's fields too."""

    @functools.wraps(endpoint)
    async def answer(request: Request) -> Response:
        response = await endpoint(request)
        if response.status_code < 400:
            return response
        message = orjson.loads(bytes(response.body)).get("error", "")
        kept = [(k, v) for k, v in response.raw_headers if k.lower() not in (b"content-length", b"content-type")]
        out = error(response.status_code, message)
        out.raw_headers.extend(kept)
        return out

    return answer


@torchserve_errors
@metered(Interface.TORCHSERVE)
async def predictions(request: Request) -> Response:
    """Classify photos, as TorchServe's image classifier does; concurrent calls are batched together."""
    app = deps.state(request)
    settings = app.settings
    timeout = client_timeout(request)
    version = request.path_params.get("version")
    served = deps.served_model(
        request, request.path_params["model"], None if version is None else version_named(version)
    )
    note(request, served)
    check_taken(served)
    body = await read_body(request, settings.max_body_bytes)
    content_type = (raw_header(request, b"content-type") or b"").decode("latin-1")
    if multipart.is_multipart(content_type):
        parts = multipart.parts(body, content_type, settings.max_request_images, "max_request_images")
        for i, part in enumerate(parts):
            if part.name not in FIELDS:
                name = multipart.shown(part.name)
                raise APIError(400, f"form.{name}: images go in fields named data or body (part {i})")
        photos = [p.data for p in parts]
        fields = [f"form.{multipart.shown(p.name)}[{i}]" for i, p in enumerate(parts)]
        payloads = [handled.Payload(p.name, p.data, "") for p in parts]
    else:  # a raw body, whatever it calls itself: curl --data-binary names it a urlencoded form
        photos, fields = ([body], ["body"]) if body else ([], ["body"])
        payloads = [handled.Payload("body", body, content_type)] if body else []
    if handled.section(served) is not None:
        return await _handled(request, served, payloads, fields, timeout)
    image_count(settings, served, len(photos), fields[0] if len(fields) == 1 else "form")
    result = await infer(app, served, decode_photos(photos, fields, served, settings), timeout)
    answered(request, result)
    answers = await stock_answers(served, result.outputs)
    body = answers[0] if len(answers) == 1 else b"[" + b",".join(answers) + b"]"
    return Response(body, media_type="application/json")


async def _handled(
    request: Request, served: ModelHandle, payloads: list[handled.Payload], fields: list[str], timeout: float | None
) -> Response:
    """A model with a handler section: its own preprocess and postprocess around the forward, called per batch of
    concurrent requests, the answers in the payloads' order (one alone, as TorchServe answers one file)."""
    app = deps.state(request)
    handled.payload_count(app.settings, served, payloads, fields)
    result = await handled.answer(app, served, app.settings, payloads, timeout)
    answered(request, result.prediction)
    answers = result.answers
    body = answers[0] if len(answers) == 1 else b"[" + b",".join(answers) + b"]"
    return Response(body, media_type="application/json")


async def explanations(request: Request) -> Response:
    """TorchServe's explanations API, which this server does not serve: TorchServe's answer to a path it has no
    route for, saying so, rather than the main port's own 404."""
    message = f"{NOT_FOUND_MESSAGE} Explanations are not served here; /predictions/<model> answers the model."
    return error(404, message, "ResourceNotFoundException")


PATHS = {"/predictions/{model}": "predictions", "/predictions/{model}/{version}": "version_predictions"}
"""The routes, and each one's OpenAPI operation name."""
METHODS = ("POST", "PUT")
"""The methods of TorchServe's inference API: ``PUT`` is what ``curl -T`` sends."""
for _path, _name in PATHS.items():
    for _method in METHODS:
        router.add_api_route(
            _path,
            predictions,
            methods=[_method],
            operation_id=f"{_name}_{_method.lower()}",
            openapi_extra=PREDICTIONS_SCHEMA,
            response_class=Response,
        )
    _explained = _path.replace("/predictions/", "/explanations/")
    router.add_api_route(_explained, explanations, methods=list(METHODS), include_in_schema=False)


@router.get(
    "/ping",
    response_class=Response,
    responses={
        **json_ok("Healthy: every model is loaded.", {"type": "object", "properties": {"status": {"type": "string"}}}),
        "503": {"description": "Unhealthy: a model is loading or failed, or the server is draining."},
    },
)
async def ping(request: Request) -> Response:
    """TorchServe's health check: ``{"status": "Healthy"}`` once the server is ready, ``Unhealthy`` (503) before."""
    if deps.not_ready(request):
        return Response(orjson.dumps({"status": "Unhealthy"}), status_code=503, media_type="application/json")
    return Response(orjson.dumps({"status": "Healthy"}), media_type="application/json")
