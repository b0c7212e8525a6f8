"""OpenAPI descriptions of the KServe V2 inference request and response, for the FastAPI route declarations."""

from __future__ import annotations

from typing import Any

from halfserve.api.http.errors import error_responses
from halfserve.api.http.limits import TIMEOUT_PARAMETER
from halfserve.manifest import DataType

_PARAMETERS: dict[str, Any] = {"type": "object", "additionalProperties": True}

_TENSOR_DATA: dict[str, Any] = {
    "type": "array",
    "description": "Row-major values, flat or nested as `shape`. FP16 and BF16 cannot travel as JSON.",
    "items": {},
}

REQUEST_INPUT: dict[str, Any] = {
    "type": "object",
    "required": ["name", "shape", "datatype"],
    "properties": {
        "name": {"type": "string"},
        "shape": {
            "type": "array",
            "items": {"type": "integer"},
            "description": "Batch first: [N, *the model's per-sample shape].",
        },
        "datatype": {
            "type": "string",
            "enum": [t.value for t in DataType],
        },
        "data": _TENSOR_DATA,
        "parameters": {
            "type": "object",
            "properties": {
                "binary_data_size": {
                    "type": "integer",
                    "description": "The tensor travels as this many bytes of binary data after the JSON header.",
                }
            },
        },
    },
}

INFERENCE_REQUEST: dict[str, Any] = {
    "type": "object",
    "required": ["inputs"],
    "properties": {
        "id": {"type": "string", "description": "Echoed in the response."},
        "parameters": {
            "type": "object",
            "properties": {
                "binary_data_output": {"type": "boolean", "description": "Return every output as binary data."},
                "timeout": {
                    "type": "integer",
                    "minimum": 0,
                    "description": "Answer 504 if the request has not started within this many microseconds (0: none).",
                },
            },
        },
        "inputs": {"type": "array", "items": REQUEST_INPUT},
        "outputs": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["name"],
                "properties": {
                    "name": {"type": "string"},
                    "parameters": {
                        "type": "object",
                        "properties": {
                            "binary_data": {"type": "boolean"},
                            "classification": {"type": "integer", "minimum": 0},
                        },
                    },
                },
            },
        },
    },
}

INFERENCE_RESPONSE: dict[str, Any] = {
    "type": "object",
    "required": ["model_name", "outputs"],
    "properties": {
        "model_name": {"type": "string"},
        "model_version": {"type": "string"},
        "id": {"type": "string"},
        "parameters": {
            "type": "object",
            "properties": {
                "precision": {
                    "type": "string",
                    "description": "The precision that computed the outputs: the served one, or fp32 where a "
                    "half-precision overflow was rerun (fp16+fp32 when only part of the rows).",
                }
            },
        },
        "outputs": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["name", "shape", "datatype"],
                "properties": {
                    "name": {"type": "string"},
                    "shape": {"type": "array", "items": {"type": "integer"}},
                    "datatype": {"type": "string"},
                    "data": _TENSOR_DATA,
                    "parameters": _PARAMETERS,
                },
            },
        },
    },
}

_BINARY_BODY = {
    "schema": {"type": "string", "format": "binary"},
    "description": (
        "Binary tensor extension: the JSON object (Inference-Header-Content-Length bytes), then each binary "
        "tensor in input order. With Inference-Header-Content-Length: 0 the whole body is the single input's "
        "data in the manifest's datatype, whole samples (a raw binary request)."
    ),
}

INFER_SCHEMA: dict[str, Any] = {
    "parameters": [
        {
            "name": "Inference-Header-Content-Length",
            "in": "header",
            "required": False,
            "schema": {"type": "integer", "minimum": 0},
            "description": "Length of the JSON object at the start of a body that carries binary tensor data.",
        },
        TIMEOUT_PARAMETER,
    ],
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {"schema": INFERENCE_REQUEST},
            "application/octet-stream": _BINARY_BODY,
        },
    },
    "responses": {
        "200": {
            "description": (
                "The outputs. When any output is binary the body is the JSON object followed by its data, with "
                "Inference-Header-Content-Length giving the JSON's length."
            ),
            "content": {
                "application/json": {"schema": INFERENCE_RESPONSE},
                "application/octet-stream": {"schema": {"type": "string", "format": "binary"}},
            },
        },
        **error_responses(
            {
                400: "Malformed request, or NaN / infinite inputs the model does not take; the error names the field.",
                401: "A shared memory region named without the admin token (Authorization: Bearer).",
                403: "A shared memory region named on a server with no admin token.",
                404: "Unknown model or version, or a model with no available version.",
                413: "Body, JSON values, rows or input values over the limits (max_body_bytes, max_json_values, ...).",
                415: "A Content-Encoding other than identity, gzip or deflate.",
                429: "A shared memory region named with a wrong admin token, after too many lately (Retry-After).",
                500: "The model failed on this request's rows (or overflowed with overflow policy error).",
                503: "Model loading or not ready, its queue full, or the request cut off by shutdown (Retry-After).",
                504: "The request's deadline (parameters.timeout, X-Request-Timeout-Ms) passed before it ran.",
                507: "No room to write an output into its shared memory region (the tmpfs holding it is full).",
            }
        ),
    },
}
