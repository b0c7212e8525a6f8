"""``POST /predict``: the simple JSON interface."""

from __future__ import annotations

from typing import Any

import numpy as np
import orjson
from fastapi import APIRouter, Request
from starlette.responses import Response

from server.api.codec import decode_samples
from server.api.errors import APIError, from_exception
from server.repository import ModelRepository

router = APIRouter()

PREDICT_SCHEMA: dict[str, Any] = {
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
                            "precision": {"type": "string"},
                            "outputs": {"type": "array"},
                            "labels": {"type": "array", "items": {"type": "string"}},
                        },
                    }
                }
            },
        }
    },
}


def parse_json(body: bytes) -> Any:
    """Decode a JSON body, or fail with a 400 naming the problem."""
    if not body:
        raise APIError(400, "body: empty; expected a JSON object")
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as e:
        raise APIError(400, f"body: malformed JSON ({e})") from None


def repository(request: Request) -> ModelRepository:
    repo: ModelRepository = request.app.state.repository
    return repo


@router.post("/predict", openapi_extra=PREDICT_SCHEMA, response_class=Response)
async def predict(request: Request) -> Response:
    """Run a list of samples through a model; concurrent calls are batched together."""
    payload = parse_json(await request.body())
    if not isinstance(payload, dict):
        raise APIError(400, f"body: expected a JSON object, got {type(payload).__name__}")
    name = payload.get("model")
    if name is not None and not isinstance(name, str):
        raise APIError(400, f"model: expected a string, got {type(name).__name__}")
    if "inputs" not in payload:
        raise APIError(400, 'inputs: missing; send {"inputs": [sample, ...]}')
    try:
        served = repository(request).get(name)
        x = decode_samples(payload["inputs"], served.manifest.inputs[0])
        out = await served.infer(x)
    except Exception as e:
        raise from_exception(e) from None
    body: dict[str, Any] = {
        "model": served.name,
        "version": served.version,
        "precision": str(served.precision),
        "outputs": out,
    }
    labels = served.manifest.labels
    if labels is not None:
        top = out.reshape(out.shape[0], -1, out.shape[-1]).argmax(-1) if out.ndim > 2 else out.argmax(-1)
        body["labels"] = np.asarray(labels, dtype=object)[top].tolist()
    return Response(orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY), media_type="application/json")
