"""The KServe V2 (Open Inference Protocol) REST endpoints: health, server and model metadata, readiness, inference.

Inference goes through the same batcher as ``/predict``, so V2 and ``/predict`` requests of the same dtype share
batches. The route only translates HTTP to and from the V2 data plane (:mod:`halfserve.api.dataplane`, which gRPC uses
too): the body split into its JSON header and binary data (the binary tensor extension, see
:mod:`halfserve.api.dataplane.codec`), decoded, submitted, and the outputs encoded as JSON or binary data, per output.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from halfserve.api.dataplane.codec import HEADER_LENGTH, split_body
from halfserve.api.dataplane.decode import parse_raw
from halfserve.api.dataplane.encode import encode_response
from halfserve.api.dataplane.infer import infer as dataplane_infer
from halfserve.api.dataplane.metadata import EXTENSIONS, SERVER_NAME, metadata
from halfserve.api.dataplane.plan import decode_request
from halfserve.api.errors import APIError
from halfserve.api.http import deps, guard
from halfserve.api.http.deps import json_response, model_route, served_model, version_of
from halfserve.api.http.errors import error_responses, json_ok
from halfserve.api.http.limits import client_timeout, raw_header, read_body
from halfserve.api.http.shm import authorised_regions
from halfserve.api.http.telemetry import answered, metered, note
from halfserve.api.http.v2_schema import INFER_SCHEMA
from halfserve.errors import InvalidInputError
from halfserve.serving import Interface, check_ready, why_model_not_ready
from halfserve.version import __version__

router = APIRouter()

# Health and metadata --------------------------------------------------------------------------------------------

_HEADER_LENGTH_KEY = HEADER_LENGTH.lower().encode()
"""The binary extension's header as the ASGI scope names it, and as a response carries it."""
_OBJECT: dict[str, Any] = {"type": "object"}
_METADATA_RESPONSES = {
    **json_ok("The model's metadata.", _OBJECT),
    **error_responses({404: "Unknown model, or a version it does not serve."}),
}
_READY_RESPONSES = {
    **json_ok("Ready.", _OBJECT),
    **error_responses({400: "Known but not ready: loading, failed or unloaded.", 404: "Unknown model or version."}),
}


@router.get("/v2", response_class=Response, responses=json_ok("Server metadata.", _OBJECT))
async def server_metadata() -> Response:
    """Server metadata: name, version and the protocol extensions supported."""
    return json_response({"name": SERVER_NAME, "version": __version__, "extensions": EXTENSIONS})


@router.get("/v2/health/live", response_class=Response, responses=json_ok("Live.", _OBJECT))
async def server_live() -> Response:
    """Liveness: 200 while the process answers."""
    return json_response({"live": True})


@router.get(
    "/v2/health/ready",
    response_class=Response,
    responses={**json_ok("Ready.", _OBJECT), **error_responses({400: "Not ready: loading, failed or draining."})},
)
async def server_ready(request: Request) -> Response:
    """Readiness: 200 once every model is loaded and warmed up; 400 before and while draining (the protocol's 4xx
    means false)."""
    why = deps.not_ready(request)
    if why:
        raise APIError(400, f"not ready: {why}")
    return json_response({"ready": True})


@model_route(router, "GET", responses=_METADATA_RESPONSES)
async def model_metadata(model_name: str, request: Request) -> Response:
    """Model metadata: versions, platform, and each input and output with its datatype and shape (batch first,
    as -1)."""
    return json_response(metadata(served_model(request, model_name, version_of(request))))


@model_route(router, "GET", "/ready", responses=_READY_RESPONSES)
async def model_ready(model_name: str, request: Request) -> Response:
    """Model readiness: 200 when ready, 400 when known but not ready (loading, failed, unloaded), 404 when unknown."""
    served = served_model(request, model_name, version_of(request))
    why = why_model_not_ready(served)
    if why is not None:
        detail = f": {served.error}" if served.error else ""
        raise APIError(400, f"model {model_name!r} is not ready: {why}{detail}")
    return json_response({"name": served.name, "ready": True})


# Inference -------------------------------------------------------------------------------------------------------


def _binary_response(header: bytes, tail: bytes) -> Response:
    response = Response(header + tail, media_type="application/octet-stream")
    response.raw_headers.append((_HEADER_LENGTH_KEY, b"%d" % len(header)))
    return response


@metered(Interface.V2)
async def infer(request: Request) -> Response:
    """``POST /v2/models/{model_name}[/versions/{model_version}]/infer``, as a plain Starlette endpoint."""
    guard.content_type(request.scope, guard.JSON_OR_BINARY)
    app = deps.state(request)
    version = version_of(request)
    served = served_model(request, request.path_params["model_name"], version)
    note(request, served)
    check_ready(served, version)
    settings = app.settings
    timeout = client_timeout(request)
    body = await read_body(request, settings.max_body_bytes)
    length = raw_header(request, _HEADER_LENGTH_KEY)
    header, binary = split_body(body, None if length is None else length.decode("latin-1"))
    if header is not None:
        regions = partial(authorised_regions, request)
        req = await decode_request(header, binary, served, settings, regions, timeout)
    else:
        assert binary is not None
        if (raw_header(request, b"content-type") or b"").startswith(b"application/json"):
            # Read as raw tensor bytes, a JSON body whose length happens to be whole samples would be served garbage.
            raise InvalidInputError(
                f"{HEADER_LENGTH}: 0 announces a raw binary body, but Content-Type is application/json; "
                "send raw tensor data as application/octet-stream",
            )
        req = parse_raw(binary, served, settings)
    result = await dataplane_infer(app, served, req.inputs, req.timeout(timeout))
    answered(request, result)
    head, tail = encode_response(served, req, result)
    if not tail:
        return Response(head, media_type="application/json")
    return _binary_response(head, tail)


@model_route(router, "POST", "/infer", openapi_extra=INFER_SCHEMA)
async def model_infer(model_name: str, request: Request) -> Response:
    """Run an inference request; concurrent requests (V2 and ``/predict``) are batched together. (Answered by
    :func:`infer` ahead of FastAPI: this declaration gives the schema.)"""
    return await infer(request)
