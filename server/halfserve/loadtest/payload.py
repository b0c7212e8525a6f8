"""Request bodies for the load test, encoded once before any load is sent.

A sweep cycles through a few distinct bodies (each holding ``rows_per_request`` samples): random data of the model's
input signature, or samples read from a JSON file. Nothing here imports torch or does I/O beyond reading that file,
so the bodies can be built in the parent and shipped to the client process as bytes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

import numpy as np
import orjson
from google.protobuf.message import DecodeError

from halfserve import grpc_messages
from halfserve.loadtest import LoadtestError
from halfserve.manifest import SERVED_TYPES, DataType

HEADER_LENGTH = "Inference-Header-Content-Length"
MAX_BODIES = 64
"""Distinct bodies per sweep: enough to avoid sending one identical payload, few enough to stay small in memory."""
MAX_RANDOM_ELEMENTS = 1 << 20
"""Cap on random values generated (about 8 MB of JSON), which bounds the bodies of big inputs and big requests."""

MAX_REQUEST_ELEMENTS = 1 << 24
"""Most values one request may carry (16.8 M: 128 MiB as float64 samples, more as JSON): a signature past it is
refused before anything is generated, so a server's listing cannot make the client allocate without bound."""
MAX_DIMS = 16
"""Most dimensions a listed input may have."""

_FLOAT_TYPES = frozenset(t.value for t in SERVED_TYPES if t.is_float)
_INT_TYPES = frozenset(t.value for t in SERVED_TYPES if t.is_integer)
"""The datatypes a model may declare, by kind: what an input's listed datatype is read as."""


class Protocol(str, Enum):
    """How a request asks for an inference."""

    PREDICT = "predict"
    """``POST /predict`` with ``{"model", "inputs": [sample, ...]}``."""
    V2_JSON = "v2-json"
    """``POST /v2/models/{model}/infer`` with the tensor as JSON ``data``."""
    V2_BINARY = "v2-binary"
    """``POST /v2/models/{model}/infer`` with the binary tensor extension, inputs and outputs as raw bytes."""
    GRPC = "grpc"
    """``inference.GRPCInferenceService/ModelInfer`` over gRPC, inputs and outputs as raw bytes
    (``raw_input_contents``)."""

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Signature:
    """A model's single input as ``GET /models`` lists it: name, datatype and per-sample shape."""

    name: str
    datatype: str
    shape: tuple[int, ...]

    @classmethod
    def from_listing(cls, entry: dict[str, Any]) -> Signature:
        """The first input of one model's ``GET /models`` entry."""
        try:
            spec = entry["inputs"][0]
            shape = spec["shape"]
            if not isinstance(shape, list) or len(shape) > MAX_DIMS or not all(type(d) is int for d in shape):
                # repr: a shape listed as a string is printed quoted, so its control characters never reach a terminal.
                raise ValueError(f"shape {shape!r:.100}: expected a list of at most {MAX_DIMS} integers")
            return cls(name=str(spec["name"]), datatype=str(spec["datatype"]), shape=tuple(shape))
        except (KeyError, IndexError, TypeError, ValueError) as e:
            raise LoadtestError(
                f"model {str(entry.get('name'))[:100]!r}: GET /models lists no usable input ({type(e).__name__}: {e})"
            ) from None

    @property
    def is_integer(self) -> bool:
        return self.datatype in _INT_TYPES


@dataclass(frozen=True)
class RequestTemplate:
    """What every virtual user sends: one method and path, fixed headers, and bodies to cycle through."""

    method: str
    path: str
    headers: dict[str, str] = field(default_factory=dict)
    bodies: tuple[bytes, ...] = (b"",)
    rows_per_request: int = 1
    grpc_target: str | None = None
    """``host:port`` of the gRPC server a ``GRPC`` template's calls go to (``path`` is the method's); None: HTTP to
    the base URL."""

    def to_message(self) -> dict[str, Any]:
        """A JSON-safe form for the client process (bodies as latin-1 text, which maps bytes 1:1)."""
        return {
            "method": self.method,
            "path": self.path,
            "headers": self.headers,
            "bodies": [b.decode("latin-1") for b in self.bodies],
            "rows_per_request": self.rows_per_request,
            "grpc_target": self.grpc_target,
        }

    @classmethod
    def from_message(cls, msg: dict[str, Any]) -> RequestTemplate:
        return cls(
            method=msg["method"],
            path=msg["path"],
            headers=dict(msg["headers"]),
            bodies=tuple(b.encode("latin-1") for b in msg["bodies"]),
            rows_per_request=int(msg["rows_per_request"]),
            grpc_target=msg.get("grpc_target"),
        )


HEALTH = RequestTemplate("GET", "/health", rows_per_request=0)
"""The server's cheapest answer: the client's own ceiling is measured against it."""


def check_signature(model: str, sig: Signature, rows_per_request: int) -> None:
    """Refuse a listed signature the load test cannot send: a dimension below 1, or requests of more than
    :data:`MAX_REQUEST_ELEMENTS` values."""
    if any(d < 1 for d in sig.shape):
        raise LoadtestError(
            f"model {model!r}: input {sig.name!r} declares shape {list(sig.shape)}; the load test needs every "
            "dimension fixed and at least 1"
        )
    values = int(np.prod(sig.shape, dtype=object)) * rows_per_request
    if values > MAX_REQUEST_ELEMENTS:
        raise LoadtestError(
            f"model {model!r}: input {sig.name!r} declares shape {list(sig.shape)}, {values:,} values per request "
            f"({rows_per_request} row(s)); the load test sends at most {MAX_REQUEST_ELEMENTS:,}"
        )


def random_samples(sig: Signature, count: int, seed: int = 0) -> np.ndarray:
    """``count`` samples of the signature: uniform in [0, 1) rounded to 4 decimals for floats (short JSON), 0..255 for
    UINT8 (image bytes), 0..9 for other integers."""
    rng = np.random.default_rng(seed)
    size = (count, *sig.shape)
    if sig.is_integer:
        return rng.integers(0, 256 if sig.datatype == DataType.UINT8 else 10, size=size, dtype=np.int64)
    return rng.uniform(0.0, 1.0, size=size).round(4)


def random_sample_count(sig: Signature, rows_per_request: int) -> int:
    """How many random samples to generate: enough for :data:`MAX_BODIES` bodies, within
    :data:`MAX_RANDOM_ELEMENTS`, and never fewer than one request's worth."""
    per_sample = int(np.prod(sig.shape))
    return max(rows_per_request, min(rows_per_request * MAX_BODIES, MAX_RANDOM_ELEMENTS // per_sample))


def load_samples(path: Path, sig: Signature) -> np.ndarray:
    """Samples from a JSON file: a list of samples, or a ``/predict`` body ``{"inputs": [...]}``.

    Each sample must have the model's per-sample shape; the error names the file and what was found.
    """
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise LoadtestError(f"--input {path}: file not found") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LoadtestError(f"--input {path}: not a JSON file ({e})") from None
    if isinstance(raw, dict) and "inputs" in raw:
        raw = raw["inputs"]
    if not isinstance(raw, list) or not raw:
        raise LoadtestError(f"--input {path}: expected a non-empty JSON list of samples (or {{'inputs': [...]}})")
    dtype = np.int64 if sig.is_integer else np.float64
    try:
        arr = np.asarray(raw, dtype=dtype)
    except (ValueError, TypeError) as e:
        raise LoadtestError(f"--input {path}: samples are not numeric arrays of one shape ({e})") from None
    if arr.shape[1:] != sig.shape:
        raise LoadtestError(
            f"--input {path}: each sample must have the model's shape {list(sig.shape)} "
            f"(input {sig.name!r}), got {list(arr.shape[1:])}"
        )
    return arr


def _wire(sig: Signature) -> tuple[str, str]:
    """The V2 datatype and little-endian numpy dtype to send: FP32 feeds any float input, INT64 any integer input;
    an input declared FP16 gets FP16, half the bytes, and one declared UINT8 gets UINT8 (what their clients send)."""
    if sig.datatype == DataType.UINT8:
        return DataType.UINT8.value, "<u1"
    if sig.is_integer:
        return DataType.INT64.value, "<i8"
    if sig.datatype == DataType.FP16:
        return DataType.FP16.value, "<f2"
    if sig.datatype in _FLOAT_TYPES:
        return DataType.FP32.value, "<f4"
    raise LoadtestError(f"input {sig.name!r}: datatype {sig.datatype[:40]!r} cannot be generated")


def encode_body(protocol: Protocol, model: str, sig: Signature, batch: np.ndarray) -> tuple[bytes, dict[str, str]]:
    """One request body carrying ``batch`` (rows first) and the headers it needs."""
    shape = [int(d) for d in batch.shape]
    opt = orjson.OPT_SERIALIZE_NUMPY
    if protocol is Protocol.PREDICT:
        body = orjson.dumps({"model": model, "inputs": batch}, option=opt)
        return body, {"content-type": "application/json"}
    datatype, dtype = _wire(sig)
    tensor: dict[str, Any] = {"name": sig.name, "shape": shape, "datatype": datatype}
    if protocol is Protocol.V2_JSON:
        tensor["data"] = np.ascontiguousarray(batch).reshape(-1)
        return orjson.dumps({"inputs": [tensor]}, option=opt), {"content-type": "application/json"}
    raw = np.ascontiguousarray(batch, dtype=dtype).tobytes()
    if protocol is Protocol.GRPC:
        request = grpc_messages.ModelInferRequest(model_name=model, raw_input_contents=[raw])
        request.inputs.add(name=sig.name, datatype=datatype, shape=shape)
        return request.SerializeToString(), {}
    tensor["parameters"] = {"binary_data_size": len(raw)}
    header = orjson.dumps({"inputs": [tensor], "parameters": {"binary_data_output": True}})
    headers = {"content-type": "application/octet-stream", HEADER_LENGTH.lower(): str(len(header))}
    return header + raw, headers


GRPC_INFER = f"/{grpc_messages.SERVICE}/ModelInfer"
"""The gRPC method an inference calls."""


def infer_path(protocol: Protocol, model: str) -> str:
    if protocol is Protocol.GRPC:
        return GRPC_INFER
    return "/predict" if protocol is Protocol.PREDICT else f"/v2/models/{model}/infer"


def build_template(
    protocol: Protocol,
    model: str,
    sig: Signature,
    samples: np.ndarray,
    rows_per_request: int,
    max_bodies: int = MAX_BODIES,
    grpc_target: str | None = None,
) -> RequestTemplate:
    """Encode up to ``max_bodies`` distinct bodies of ``rows_per_request`` samples each, taking ``samples`` in order
    and wrapping around (so a file with fewer samples than a request needs still fills it)."""
    if rows_per_request < 1:
        raise LoadtestError(f"--rows-per-request: expected at least 1, got {rows_per_request}")
    if len(samples) == 0:
        raise LoadtestError("no samples to send")
    count = max(1, min(max_bodies, -(-len(samples) // rows_per_request)))
    bodies: list[bytes] = []
    headers: dict[str, str] = {}
    for i in range(count):
        idx = np.arange(i * rows_per_request, (i + 1) * rows_per_request) % len(samples)
        body, headers = encode_body(protocol, model, sig, samples[idx])
        bodies.append(body)
    if protocol is Protocol.GRPC:
        if grpc_target is None:
            raise LoadtestError("--protocol grpc needs the server's gRPC address")
        return RequestTemplate("GRPC", GRPC_INFER, {}, tuple(bodies), rows_per_request, grpc_target)
    return RequestTemplate("POST", infer_path(protocol, model), headers, tuple(bodies), rows_per_request)


def served_precision(protocol: Protocol, body: bytes, headers: dict[str, str]) -> str | None:
    """The precision an inference response says served it (``None`` if it does not say)."""
    if protocol is Protocol.GRPC:
        try:
            response = grpc_messages.ModelInferResponse.FromString(body)
        except DecodeError:
            return None
        return str(response.parameters["precision"].string_param) or None
    try:
        if protocol is Protocol.PREDICT:
            value = orjson.loads(body).get("precision")
        else:
            length = headers.get(HEADER_LENGTH.lower())
            header = orjson.loads(body[: int(length)] if length is not None else body)
            value = header.get("parameters", {}).get("precision")
    except (orjson.JSONDecodeError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None
