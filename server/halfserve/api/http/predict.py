"""``POST /predict``: the simple JSON interface."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import orjson
from fastapi import APIRouter, Request
from starlette.responses import Response

from halfserve.api.access import of_version
from halfserve.api.dataplane.bounds import check_size, parse_json
from halfserve.api.dataplane.codec import decode_samples, encode_texts
from halfserve.api.dataplane.decode import from_base64
from halfserve.api.dataplane.infer import infer
from halfserve.api.dataplane.photos import decode_photos, image_count, no_images
from halfserve.api.dataplane.signature import Wording, check_shape
from halfserve.api.http import deps, guard
from halfserve.api.http.errors import as_json, error_responses
from halfserve.api.http.limits import TIMEOUT_PARAMETER, client_timeout, read_body
from halfserve.api.http.telemetry import answered, metered, note
from halfserve.manifest import TensorSpec, sent_inputs
from halfserve.serving import Interface, InvalidInputError, ModelHandle
from halfserve.settings import Settings

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


async def decode_inputs(
    samples: object, served: ModelHandle, settings: Settings, field: str = "inputs"
) -> dict[str, np.ndarray]:
    """``samples`` (a request's ``inputs``) as the model's named inputs: a list of samples for a model with one
    input, else a mapping of input name to its samples (every input, the same number of samples each); texts tokenized
    off the event loop.

    Awaited inside :func:`~halfserve.api.dataplane.infer.infer`, so it raises domain errors, as the data plane does;
    ``field`` names the samples in them (KServe V1's route gives ``instances``)."""
    specs = sent_inputs(served.manifest)
    text = served.manifest.text
    if text is not None:
        if len(specs) == 1 and isinstance(samples, list) and samples and isinstance(samples[0], str):
            for i, t in enumerate(samples):
                if not isinstance(t, str):  # a list of texts with one that is not had read "values must be numbers"
                    raise InvalidInputError(f"{field}[{i}]: expected a text, as {field}[0] is, got {type(t).__name__}")
            samples = {text.input: samples}
        if isinstance(samples, dict) and text.input in samples:
            texts = samples[text.input]
            if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
                raise InvalidInputError(f"{field}.{text.input}: expected a list of texts")
            check_size(settings, served, len(texts), f"{field}.{text.input}")
            rest = {k: v for k, v in samples.items() if k != text.input}
            if text.feeds in rest:
                raise InvalidInputError(f"{field}: give {text.input!r} or {text.feeds!r}, not both")
            others = [t for t in specs if t.name != text.feeds]
            decoded = {t.name: _samples(rest.get(t.name), t, served, f"{field}.{t.name}") for t in others}
            return await encode_texts(texts, f"{field}.{text.input}", served, settings) | decoded
    image = served.manifest.image
    if image is not None and isinstance(samples, dict) and image.input in samples:  # the photos by their input's name
        if len(samples) > 1:
            raise InvalidInputError(f"{field}: give {image.input!r} (photos) or {image.feeds!r}, not both")
        photos = samples[image.input]
        if not isinstance(photos, list) or not photos:
            raise InvalidInputError(f'{field}.{image.input}: expected a list of {{"b64": "<base64 of a photo>"}}')
        return await _photos(photos, served, settings, f"{field}.{image.input}")
    if isinstance(samples, list) and samples and isinstance(samples[0], dict):
        if image is not None:
            return await _photos(samples, served, settings, field)
        if "b64" in samples[0]:  # KServe v1's photo, named as /predictions names photos a model cannot take
            raise no_images(served, f"{field}[0].b64")
    if len(specs) == 1 and not isinstance(samples, dict):  # a mapping is checked by name, as for several inputs
        if isinstance(samples, list):
            check_size(settings, served, len(samples), field)
        return {specs[0].name: _samples(samples, specs[0], served, field)}
    names = [t.name for t in specs]
    if not isinstance(samples, dict):
        example = ", ".join(f'"{n}": [sample, ...]' for n in names)
        raise InvalidInputError(f"{field}: model {served.name!r} takes several inputs; send {{{example}}}")
    for name in samples:
        if name not in names:
            raise InvalidInputError(f"{field}.{name}: unexpected input; the model takes {names}")
    for name in names:
        if name not in samples:
            raise InvalidInputError(f"{field}.{name}: missing; the model takes {names}")
        if not isinstance(samples[name], list):
            raise InvalidInputError(f"{field}.{name}: expected a list of samples, got {type(samples[name]).__name__}")
    rows = len(samples[names[0]])
    for name in names[1:]:
        if len(samples[name]) != rows:
            raise InvalidInputError(
                f"{field}.{name}: {len(samples[name])} samples, but {names[0]!r} has {rows}; every input needs one "
                "per row",
            )
    check_size(settings, served, rows, field)
    return {t.name: _samples(samples[t.name], t, served, f"{field}.{t.name}") for t in specs}


async def _photos(samples: list[Any], served: ModelHandle, settings: Settings, field: str) -> dict[str, np.ndarray]:
    """KServe v1's encoded photos, ``[{"b64": "..."}, ...]`` (one per sample), decoded off the event loop into the
    input the manifest's ``image`` section feeds: counted against ``max_request_images`` before any is read."""
    image_count(settings, served, len(samples), field)
    photos = []
    for i, sample in enumerate(samples):
        value = sample.get("b64") if isinstance(sample, dict) else None
        if not isinstance(value, str) or len(sample) != 1:
            raise InvalidInputError(f'{field}[{i}]: expected {{"b64": "<base64 of a photo>"}}')
        photos.append(from_base64(value, f"{field}[{i}].b64"))
    return await decode_photos(photos, [f"{field}[{i}].b64" for i in range(len(photos))], served, settings)


def _samples(samples: object, spec: TensorSpec, served: ModelHandle, field: str) -> np.ndarray:
    """One input's samples as the batcher's array, its shape checked by the rule V2 uses too (the request's rows are
    held to their limits before any input is decoded, by the same ``check_size``)."""
    x = decode_samples(samples, spec, field)
    check_shape(list(x.shape), spec, served, None, field, Wording.SAMPLES)
    return x


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
    payload = await parse_json(await read_body(request, settings.max_body_bytes), settings.max_json_values)
    if not isinstance(payload, dict):
        raise InvalidInputError(f"body: expected a JSON object, got {type(payload).__name__}")
    for key in payload:
        if key not in FIELDS:  # a misspelt field had been left out silently (KServe v1's "instances" too)
            raise InvalidInputError(
                f"{as_json(key)[1:-1]}: unexpected field; /predict reads inputs, and model and version if given"
            )
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
