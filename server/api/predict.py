"""``POST /predict``: the simple JSON interface."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import orjson
from fastapi import APIRouter, Request
from starlette.responses import Response

from server.api import deps, guard
from server.api.codec import decode_samples
from server.api.errors import APIError, cut_off_by_shutdown, error_responses, from_exception
from server.api.limits import TIMEOUT_HEADER, check_size, client_timeout, parse_json, read_body
from server.api.telemetry import answered, metered, note
from server.serving import Interface

router = APIRouter()

PREDICT_SCHEMA: dict[str, Any] = {
    "parameters": [
        {
            "name": TIMEOUT_HEADER,
            "in": "header",
            "required": False,
            "schema": {"type": "number", "exclusiveMinimum": 0, "maximum": 3_600_000},
            "description": "Answer 504 if the request's rows have not all started within this many milliseconds.",
        }
    ],
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {
                "schema": {
                    "type": "object",
                    "required": ["inputs"],
                    "properties": {
                        "model": {"type": "string", "description": "Optional when one model is served."},
                        "inputs": {
                            "type": "array",
                            "minItems": 1,
                            "description": "Samples, each a nested list of the model's per-sample input shape.",
                            "items": {},
                        },
                    },
                }
            }
        },
    },
    "responses": {
        "200": {
            "description": "One output per sample, and the top label per sample when the model has labels.",
            "content": {
                "application/json": {
                    "schema": {
                        "type": "object",
                        "required": ["model", "version", "precision", "outputs"],
                        "properties": {
                            "model": {"type": "string"},
                            "version": {"type": "integer"},
                            "precision": {
                                "type": "string",
                                "description": "The precision that computed the outputs: the served one, or fp32 "
                                "where a half-precision overflow was rerun (fp16+fp32 when only part of the rows).",
                            },
                            "outputs": {
                                "type": "array",
                                "description": "Non-finite values (overflow policy allow) are written as null.",
                            },
                            "labels": {"type": "array"},
                        },
                    }
                }
            },
        },
        **error_responses(
            {
                400: "Malformed request, or NaN / infinite inputs the model does not take; the error names the field.",
                404: "Unknown model.",
                413: "Body, JSON values, rows or input values over the limits (max_body_bytes, max_json_values, ...).",
                500: "The model failed on this request's rows (or overflowed with overflow policy error).",
                503: "Queue full, model not loaded, or the request cut off by shutdown (with Retry-After).",
                504: "The request's deadline passed before its rows had all started.",
            }
        ),
    },
}


@router.post("/predict", openapi_extra=PREDICT_SCHEMA, response_class=Response)
@metered(Interface.PREDICT)
async def predict(request: Request) -> Response:
    """Run a list of samples through a model; concurrent calls are batched together."""
    guard.content_type(request.scope, guard.JSON)
    app = deps.state(request)
    limits = app.settings
    timeout = client_timeout(request)
    payload = await parse_json(await read_body(request, limits.max_body_bytes), limits.max_json_values)
    if not isinstance(payload, dict):
        raise APIError(400, f"body: expected a JSON object, got {type(payload).__name__}")
    name = payload.get("model")
    if name is not None and not isinstance(name, str):
        raise APIError(400, f"model: expected a string, got {type(name).__name__}")
    if "inputs" not in payload:
        raise APIError(400, 'inputs: missing; send {"inputs": [sample, ...]}')
    samples = payload["inputs"]
    try:
        served = app.service.get(name)
        note(request, served)
        if isinstance(samples, list):
            check_size(limits, served, len(samples), "inputs")
        # No finiteness check: JSON carries no NaN or infinity, and decoding refuses numbers the dtype cannot hold.
        spec = served.manifest.inputs[0]
        result = await served.submit({spec.name: decode_samples(samples, spec)}, timeout)
        answered(request, result)
    except asyncio.CancelledError:
        if not app.draining:
            raise
        raise cut_off_by_shutdown() from None
    except Exception as e:
        raise from_exception(e) from None
    out = result.outputs[served.manifest.outputs[0].name]
    body: dict[str, Any] = {
        "model": served.name,
        "version": served.version,
        "precision": result.precision,
        "outputs": out,
    }
    labels = served.manifest.labels
    if labels is not None:
        top = out.reshape(out.shape[0], -1, out.shape[-1]).argmax(-1) if out.ndim > 2 else out.argmax(-1)
        body["labels"] = np.asarray(labels, dtype=object)[top].tolist()
    return Response(orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY), media_type="application/json")
