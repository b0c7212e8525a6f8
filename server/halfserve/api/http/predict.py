"""``POST /predict``: the simple JSON interface."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import orjson
from fastapi import APIRouter, Request
from starlette.responses import Response

from halfserve.api.access import check_taken, of_version
from halfserve.api.dataplane.infer import infer
from halfserve.api.dataplane.samples import decode_inputs
from halfserve.api.http import deps, guard
from halfserve.api.http.errors import as_json, error_responses
from halfserve.api.http.limits import TIMEOUT_PARAMETER, client_timeout, read_fields
from halfserve.api.http.telemetry import answered, metered, note
from halfserve.errors import InvalidInputError
from halfserve.serving import Interface

router = APIRouter()

FIELDS = frozenset({"model", "version", "inputs"})
"""The fields of a ``/predict`` body: any other is refused, naming it."""

PREDICT_SCHEMA: dict[str, Any] = {
    "parameters": [TIMEOUT_PARAMETER],
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {
                "schema": {
                    "type": "object",
                    "required": ["inputs"],
                    "additionalProperties": False,
                    "properties": {
                        "model": {"type": "string", "description": "Optional when one model is served."},
                        "version": {
                            "anyOf": [{"type": "integer"}, {"type": "string"}],
                            "description": "Optional: the version the model must be serving (any other is a 404).",
                        },
                        "inputs": {
                            "anyOf": [{"type": "array", "minItems": 1, "items": {}}, {"type": "object"}],
                            "description": "Samples, each a nested list of the model's per-sample input shape; for "
                            "a model with several inputs, an object of input name to its samples; for a model that "
                            'takes photos, [{"b64": "<base64 of a JPEG, PNG or WebP>"}, ...].',
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
                                "anyOf": [{"type": "array"}, {"type": "object"}],
                                "description": "One output per sample (non-finite values, overflow policy allow, are "
                                "written as null); for a model with several outputs, an object of output name to its "
                                "rows.",
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


PYTHON_ARGMAX_VALUES = 256
"""Outputs of up to this many values find their top labels in Python; larger ones with numpy's ``argmax``.

``argmax`` releases the GIL at any size (``max`` and most small numpy calls do not), and each release hands the GIL
to any thread waiting for it, such as a forward's thread about to free its input, and leaves the event loop waiting
to take it back. Once per request that measured 5-9% of ``/predict``'s throughput on the 256-1024-1024-10 MLP (fp32,
c=64, 3 interleaved rounds); in Python a 1x10 output's top label costs 0.4 us against numpy's 0.7 us, and 4x10 1.4 us
against 0.7 us.
"""


def top_labels(out: np.ndarray, labels: list[str]) -> list[Any]:
    """The label of each sample's highest output (of each position's, for an output with positions between the rows
    and the classes), picked as numpy's ``argmax`` picks: the first of equal maxima; None for a row holding a NaN,
    which has no highest (argmax names its first NaN's class: a confident label for no answer)."""
    scores = out.reshape(len(out), -1, out.shape[-1]) if out.ndim > 2 else out
    flat = scores.reshape(-1, scores.shape[-1])
    rows: list[list[float]] = flat.tolist() if flat.size <= PYTHON_ARGMAX_VALUES else []
    # A row's sum is NaN when it holds a NaN (or infinities of both signs): those rows go to numpy.
    if rows and not any(math.isnan(sum(row)) for row in rows):
        named: list[str | None] = [labels[row.index(max(row))] for row in rows]
    else:
        nan = np.isnan(flat).any(-1).tolist()
        named = [None if n else labels[i] for i, n in zip(flat.argmax(-1).tolist(), nan, strict=True)]
    if scores.ndim == 2:
        return named
    width = scores.shape[1]
    return [named[i : i + width] for i in range(0, len(named), width)]


@router.post("/predict", openapi_extra=PREDICT_SCHEMA, response_class=Response)
@metered(Interface.PREDICT)
async def predict(request: Request) -> Response:
    """Run a list of samples through a model; concurrent calls are batched together."""
    guard.content_type(request.scope, guard.JSON)
    app = deps.state(request)
    settings = app.settings
    timeout = client_timeout(request)
    payload = await read_fields(request, settings, FIELDS, "/predict reads inputs, and model and version if given")
    name = payload.get("model")
    if name is not None and not isinstance(name, str):
        raise InvalidInputError(f"model: expected a string, got {type(name).__name__}")
    if "inputs" not in payload:
        raise InvalidInputError('inputs: missing; send {"inputs": [sample, ...]}')
    samples = payload["inputs"]
    version = payload.get("version")
    # "" is no version either: a client asking for any version leaves the field out.
    if version is not None and (isinstance(version, bool) or not isinstance(version, int | str) or version == ""):
        raise InvalidInputError(f"version: expected an integer, got {as_json(version)}")
    served = of_version(app.service.get(name), None if version is None else str(version))
    note(request, served)
    check_taken(served)  # before its photos or texts are decoded: the model's state is the answer
    # No finiteness check: JSON carries no NaN or infinity, and decoding refuses numbers the dtype cannot hold.
    result = await infer(app, served, decode_inputs(samples, served, settings), timeout)
    answered(request, result)
    specs = served.manifest.outputs
    out = result.outputs[specs[0].name]
    body: dict[str, Any] = {
        "model": served.name,
        "version": served.version,
        "precision": result.precision,
        "outputs": out if len(specs) == 1 else {t.name: result.outputs[t.name] for t in specs},
    }
    labels = served.manifest.labels
    if labels is not None and served.manifest.answer is None:  # an answer's labels name detections, not columns
        body["labels"] = top_labels(out, labels)
    return Response(orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY), media_type="application/json")
