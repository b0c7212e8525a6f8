"""The KServe V2 (Open Inference Protocol) REST endpoints: health, server and model metadata, readiness, inference.

Inference goes through the same batcher as ``/predict``, so V2 and ``/predict`` requests of the same dtype share
batches. Tensors arrive as JSON ``data`` or as binary data after the JSON header (the binary tensor extension, see
:mod:`server.api.codec`), and outputs leave either way, per output.

Datatypes. A request's input datatype need not equal the manifest's; it must be able to feed it:

* a floating input (FP32, FP16, BF16, FP64 in the manifest) takes any float or integer datatype, converted to the
  manifest's dtype (float32 for FP32 and BF16 inputs) like ``/predict``'s JSON numbers. BF16 arrives exactly, as
  float32; FP16 stays float16 when the model is served in fp16 (or declares FP16), so the engine's cast is a no-op
  rather than a round trip through float32, and is widened exactly to float32 otherwise, so it can share batches;
* an integer input (INT32, INT64) takes integer datatypes only, range-checked;
* BOOL and BYTES feed nothing; a datatype the protocol does not define is a 400.

FP16 and BF16 data travel only as binary data: JSON has no 16-bit floats, so such JSON ``data`` is a 400, and an
FP16/BF16 output must be requested as binary.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import orjson
from fastapi import APIRouter, Request
from starlette.responses import Response

from server.api import deps, guard
from server.api.admin import PLATFORM
from server.api.codec import (
    HEADER_LENGTH,
    JSON_UNSUPPORTED,
    WireType,
    check_range,
    checked_length,
    decode_binary,
    decode_json,
    element_count,
    encode_binary,
    encode_bytes,
    encode_texts,
    split_body,
    wire_type,
    wire_values,
)
from server.api.deps import json_response, model_route, served_model, version_of
from server.api.errors import APIError, count, cut_off_by_shutdown, error_responses, from_exception, json_ok
from server.api.limits import check_finite, check_size, client_timeout, parse_json, raw_header, read_body
from server.api.shm import RegionSource, Span, authorised_regions, span
from server.api.telemetry import answered, metered, note
from server.api.v2_schema import INFER_SCHEMA
from server.manifest import Manifest, Precision, TensorSpec, sent_inputs
from server.serving import Interface, ModelHandle, ModelState, Prediction, check_ready
from server.settings import Settings
from server.version import __version__

router = APIRouter()

SERVER_NAME = "halfserve"
EXTENSIONS = [
    "binary_tensor_data",
    "classification",
    "model_configuration",
    "statistics",
    "model_repository",
    "system_shared_memory",
]


def tensor_metadata(spec: TensorSpec) -> dict[str, object]:
    return {"name": spec.name, "datatype": spec.datatype.value, "shape": [-1, *spec.shape]}


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


def metadata(served: ModelHandle) -> dict[str, Any]:
    """The protocol's model metadata of ``served`` (HTTP and gRPC alike)."""
    m = served.manifest
    return {
        "name": served.name,
        "versions": [str(served.version)],
        "platform": PLATFORM,
        "inputs": [tensor_metadata(s) for s in sent_inputs(m)]
        + ([{"name": m.text.input, "datatype": "BYTES", "shape": [-1, 1]}] if m.text is not None else []),
        "outputs": [tensor_metadata(s) for s in m.outputs],
    }


@model_route(router, "GET", "/ready", responses=_READY_RESPONSES)
async def model_ready(model_name: str, request: Request) -> Response:
    """Model readiness: 200 when ready, 400 when known but not ready (loading, failed, unloaded), 404 when unknown."""
    served = served_model(request, model_name, version_of(request))
    if served.state is not ModelState.READY:
        detail = f": {served.error}" if served.error else ""
        raise APIError(400, f"model {model_name!r} is not ready: {served.state.value}{detail}")
    return json_response({"name": served.name, "ready": True})


# Inference -------------------------------------------------------------------------------------------------------


@dataclass
class Inference:
    """A decoded inference request, ready for the batcher."""

    inputs: dict[str, np.ndarray]
    request_id: str | None
    binary_output: bool
    timeout_us: int = 0
    """The request's own ``parameters.timeout`` in microseconds; 0: none."""
    classes: int = 0
    """The top classes to return per row instead of the output (the classification extension); 0: the output."""
    output_span: Span | None = None
    """Where in shared memory the output goes (the shared memory extension); None: in the body."""
    outputs: dict[str, OutputRequest] | None = None
    """For a model with several outputs, the ones to return and how (None: the only output, as above)."""
    plan: RequestPlan | None = None
    """What its JSON header decided, when the header is one the route keeps (:class:`RequestPlan`)."""
    texts: tuple[Sequence[bytes | str], str] | None = None
    """A text model's texts and their field, checked but not yet tokenized: :func:`tokenize` does that off the event
    loop and adds the token ids to ``inputs``."""

    def timeout(self, client: float | None) -> float | None:
        """Seconds the request may wait in the queue: the shorter of ``client`` (the transport's: a header, a gRPC
        deadline) and ``parameters.timeout``; None for neither."""
        if not self.timeout_us:
            return client
        own = self.timeout_us / 1e6
        return own if client is None else min(client, own)

    @property
    def x(self) -> np.ndarray:
        """The first input's rows (a model with one input: its only one)."""
        return next(iter(self.inputs.values()))


@dataclass
class OutputRequest:
    """How one output goes back: as binary data or JSON, as its top classes, or into shared memory."""

    binary: bool
    classes: int = 0
    span: Span | None = None


def wrong_datatype(field: str, spec: TensorSpec, wire: WireType, model: str) -> APIError:
    """The 400 for data of datatype ``wire`` sent to ``spec``, in Triton's words, with the datatypes it does take."""
    kind = spec.datatype.numpy.kind
    takes = "BOOL only" if kind == "b" else "floating or integer data" if kind == "f" else "integer data"
    return APIError(
        400,
        f"{field}: inference input {spec.name!r} data-type is {wire.value!r}, but model {model!r} expects "
        f"{spec.datatype.value!r} (it takes {takes})",
    )


def to_input_dtype(
    arr: np.ndarray, wire: WireType, spec: TensorSpec, fp16_weights: bool, field: str, model: str
) -> np.ndarray:
    """``arr`` (of datatype ``wire``) as the array the batcher takes for ``spec`` of ``model``; the rules are in the
    module's docstring. A binary body's rows stay a read-only view of the body when their dtype is already the
    target's: :meth:`~server.repository.ServedModel.submit` copies them for the engine, a front-end into its shared
    slot."""
    target = spec.datatype.numpy
    if target.kind == "b" or wire is WireType.BOOL:
        if not (target.kind == "b" and wire is WireType.BOOL):
            raise wrong_datatype(field, spec, wire, model)
        return arr
    if target.kind == "f":
        if not (wire.is_float or wire.is_integer):
            raise wrong_datatype(field, spec, wire, model)
        if wire is WireType.FP16 and (target == np.float16 or fp16_weights):
            target = np.dtype(np.float16)
    else:
        if not wire.is_integer:
            raise wrong_datatype(field, spec, wire, model)
        check_range(arr, target, field)
    if arr.dtype == target:
        return arr
    # Floats beyond the target's range become infinite here, silently: the finiteness check that follows names them.
    with np.errstate(over="ignore", invalid="ignore"):
        return arr.astype(target, copy=False)


def _input_shape(shape: object, spec: TensorSpec, field: str, model: str) -> list[int]:
    if type(shape) is list and shape and type(shape[0]) is int and shape[0] >= 1 and shape[1:] == spec.shape:
        return shape  # the common case, checked first: it runs on every request
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) for d in shape):
        raise APIError(400, f"{field}: expected a list of integers")
    if spec.variable and len(shape) == len(spec.shape) + 1 and shape[2:] == spec.shape[1:]:
        if shape[0] < 1 or shape[1] < 1:
            raise APIError(400, f"{field}: the batch and length dimensions must be at least 1, got {shape}")
        checked_length(spec, shape[1], field)
        return shape
    if len(shape) != len(spec.shape) + 1 or shape[1:] != spec.shape:
        dims = ", ".join("L" if d == -1 else str(d) for d in spec.shape)
        raise APIError(
            400,
            f"{field}: unexpected shape for input {spec.name!r} for model {model!r}. "
            f"Expected {_dims([-1, *spec.shape])}, got {_dims(shape)}: send [N, {dims}] (batch first)",
        )
    if shape[0] < 1:
        raise APIError(400, f"{field}: the batch dimension must be at least 1, got {shape[0]}")
    return shape


def _dims(shape: list[int]) -> str:
    """A shape as Triton writes one in its messages: ``[-1,3,224,224]``."""
    return "[" + ",".join(str(d) for d in shape) + "]"


def _params(obj: dict[str, Any], field: str) -> dict[str, Any]:
    params = obj.get("parameters", {})
    if not isinstance(params, dict):
        raise APIError(400, f"{field}: expected an object, got {type(params).__name__}")
    return params


def _flag(params: dict[str, Any], key: str, field: str, default: bool) -> bool:
    value = params.get(key, default)
    if not isinstance(value, bool):
        raise APIError(400, f"{field}.{key}: expected true or false, got {value!r}")
    return value


def _decode_input(
    item: object,
    field: str,
    binary: memoryview | None,
    served: ModelHandle,
    limits: Settings | None,
    regions: RegionSource | None,
    specs: list[TensorSpec],
) -> tuple[np.ndarray, TensorSpec, int]:
    """An entry of ``inputs`` (one of ``specs``, the inputs clients send) as the batcher's array, its input's spec,
    and how many bytes of ``binary`` it took (from the start)."""
    if not isinstance(item, dict):
        raise APIError(400, f"{field}: expected an object, got {type(item).__name__}")
    spec = next((t for t in specs if t.name == item.get("name")), None)
    if spec is None:
        raise APIError(
            400,
            f"{field}.name: unexpected inference input {item.get('name')!r} for model {served.name!r}; "
            f"the model takes {_takes(specs, served.manifest)}",
        )
    wire = wire_type(item.get("datatype"), f"{field}.datatype")
    shape = _input_shape(item.get("shape"), spec, f"{field}.shape", served.name)
    if limits is not None:
        check_size(limits, served, shape[0], f"{field}.shape")
    params = _params(item, f"{field}.parameters")
    size = params.get("binary_data_size")
    if "shared_memory_region" in params:
        if size is not None or "data" in item:
            raise APIError(400, f"{field}: give one of data, binary_data_size or shared_memory_region")
        where = f"{field}.parameters"
        # A copy of the client's bytes, so the batcher's array stays as it was read whatever the client does next.
        raw = span(regions, params, where).read()
        arr, size = decode_binary(raw, wire, shape, f"{where}.shared_memory_byte_size"), 0
    elif size is not None:
        where = f"{field}.parameters.binary_data_size"
        size = count(size, where, "a byte count")
        if "data" in item:
            raise APIError(400, f"{field}: give either data or parameters.binary_data_size, not both")
        if binary is None:
            raise APIError(400, f"{where}: binary data needs an {HEADER_LENGTH} header")
        if size > len(binary):
            raise APIError(
                400,
                f"{where}: inputs declare {size} bytes of binary data, "
                f"but the body has {len(binary)} after the {HEADER_LENGTH} bytes of JSON",
            )
        arr = decode_binary(binary[:size], wire, shape, where)
    elif "data" in item:
        arr, size = decode_json(item["data"], wire, shape, f"{field}.data"), 0
    else:
        raise APIError(400, f"{field}: no tensor data; give data or parameters.binary_data_size")
    return _checked_input(arr, wire, spec, served, field, json=size == 0), spec, size


def _checked_input(
    arr: np.ndarray, wire: WireType, spec: TensorSpec, served: ModelHandle, field: str, json: bool
) -> np.ndarray:
    """A decoded input entry as the batcher's array for ``spec``: converted to its dtype, checked to be finite."""
    x = to_input_dtype(arr, wire, spec, served.precision is Precision.FP16, f"{field}.datatype", served.name)
    check_finite(x, served, f"{field}.data" if json else f"{field} (binary data)")
    return x


def unknown_output(field: str, got: object, model: str, names: list[str]) -> APIError:
    """The 400 for an output the model does not have, in Triton's words, with those it has."""
    has = repr(names[0]) if len(names) == 1 else str(names)
    return APIError(400, f"{field}.name: unexpected inference output {got!r} for model {model!r}; the model has {has}")


def _requested_output(
    payload: dict[str, Any], default: bool, out_spec: TensorSpec, regions: RegionSource | None, model: str
) -> tuple[bool, int, Span | None]:
    """How the output goes: as binary data or not (its own ``binary_data``, else the request's
    ``binary_data_output``), how many top classes to send instead of it (``classification``; 0 for none), and the
    shared memory it goes to instead of the body (``shared_memory_region``)."""
    binary, classes, region = default, 0, None
    requested = payload.get("outputs")
    if requested is not None:
        if not isinstance(requested, list):
            raise APIError(400, f"outputs: expected a list, got {type(requested).__name__}")
        for i, item in enumerate(requested):
            field = f"outputs[{i}]"
            if not isinstance(item, dict) or item.get("name") != out_spec.name:
                got = item.get("name") if isinstance(item, dict) else item
                raise unknown_output(field, got, model, [out_spec.name])
            params = _params(item, f"{field}.parameters")
            classes = count(params.get("classification", 0), f"{field}.parameters.classification", "a class count")
            binary = _flag(params, "binary_data", f"{field}.parameters", default)
            if "shared_memory_region" in params:
                if classes:
                    raise APIError(400, f"{field}.parameters: classification answers in the body, not shared memory")
                region = span(regions, params, f"{field}.parameters")
    if region is not None:
        return False, 0, region
    if not (binary or classes) and wire_type(out_spec.datatype.value, out_spec.name) in JSON_UNSUPPORTED:
        kind = out_spec.datatype.value
        raise APIError(400, f"outputs: {out_spec.name!r} is {kind}; JSON has no 16-bit floats, request binary_data")
    return binary, classes, region


def _requested_outputs(
    payload: dict[str, Any], default: bool, specs: list[TensorSpec], regions: RegionSource | None, model: str
) -> dict[str, OutputRequest]:
    """For a model with several outputs: the outputs to return (those ``outputs`` names, else all), each as binary
    data or not (its own ``binary_data``, else the request's ``binary_data_output``), as its top classes
    (``classification``) or into shared memory (``shared_memory_region``)."""
    requested = payload.get("outputs")
    if requested is None:
        wanted: dict[str, OutputRequest] = {t.name: OutputRequest(default) for t in specs}
    else:
        if not isinstance(requested, list):
            raise APIError(400, f"outputs: expected a list, got {type(requested).__name__}")
        names = [t.name for t in specs]
        wanted = {}
        for i, item in enumerate(requested):
            field = f"outputs[{i}]"
            got = item.get("name") if isinstance(item, dict) else item
            if not isinstance(item, dict) or got not in names:
                raise unknown_output(field, got, model, names)
            if got in wanted:
                raise APIError(400, f"{field}.name: output {got!r} is requested twice")
            params = _params(item, f"{field}.parameters")
            classes = count(params.get("classification", 0), f"{field}.parameters.classification", "a class count")
            out = OutputRequest(_flag(params, "binary_data", f"{field}.parameters", default), classes)
            if "shared_memory_region" in params:
                if classes:
                    raise APIError(400, f"{field}.parameters: classification answers in the body, not shared memory")
                out.span = span(regions, params, f"{field}.parameters")
            wanted[got] = out
    for spec in specs:
        how = wanted.get(spec.name)
        if how is None or how.span is not None or how.classes or how.binary:
            continue
        if wire_type(spec.datatype.value, spec.name) in JSON_UNSUPPORTED:
            kind = spec.datatype.value
            raise APIError(400, f"outputs: {spec.name!r} is {kind}; JSON has no 16-bit floats, request binary_data")
    return wanted


def _takes(specs: list[TensorSpec], manifest: Manifest) -> str:
    """The inputs a client sends, named: a text model's text input too, given instead of the one it feeds."""
    if manifest.text is not None:
        feeds = manifest.text.feeds
        others = [t.name for t in specs if t.name != feeds]
        text = f"text input {manifest.text.input!r} (BYTES, one text per row) or {feeds!r}"
        return text + (f", with {others}" if others else "")
    return f"input {specs[0].name!r}" if len(specs) == 1 else f"inputs {[t.name for t in specs]}"


def check_input_count(given: int, served: ModelHandle, specs: list[TensorSpec] | None = None) -> None:
    """A 400 when a request has more input entries than ``served`` takes (``specs``: its inputs clients send, when
    the caller has them): checked before any is decoded."""
    specs = sent_inputs(served.manifest) if specs is None else specs
    if given > len(specs) + (served.manifest.text is not None):
        raise APIError(
            400,
            f"inputs: expected {len(specs)} inputs but got {given} inputs for model {served.name!r}; "
            f"the model takes {_takes(specs, served.manifest)}",
        )


def _names(names: list[str]) -> str:
    """Names as Triton lists them in its messages: ``['INPUT0','INPUT1']``."""
    return "[" + ",".join(f"'{n}'" for n in names) + "]"


def parse_request(
    payload: object,
    binary: memoryview | None,
    served: ModelHandle,
    limits: Settings | None = None,
    regions: RegionSource | None = None,
) -> Inference:
    """Decode a V2 inference request for ``served``: its JSON header, and the binary data after it (``None`` when
    the request has no ``Inference-Header-Content-Length`` and so is all JSON). ``limits`` bounds its size;
    ``regions`` gives the shared memory regions it may name, asked only when it names one."""
    if not isinstance(payload, dict):
        raise APIError(400, f"body: expected a JSON object, got {type(payload).__name__}")
    specs = sent_inputs(served.manifest)
    request_id = payload.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise APIError(400, f"id: expected a string, got {type(request_id).__name__}")
    params = _params(payload, "parameters")
    binary_output = _flag(params, "binary_data_output", "parameters", False)
    timeout = count(params.get("timeout", 0), "parameters.timeout", "non-negative microseconds")
    inputs = payload.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise APIError(400, f"inputs: expected a non-empty list; the model takes {_takes(specs, served.manifest)}")
    check_input_count(len(inputs), served, specs)
    text = served.manifest.text
    tensors: dict[str, np.ndarray] = {}
    pending: tuple[Sequence[bytes | str], str] | None = None  # texts, tokenized by the caller (tokenize)
    declared = 0
    for i, item in enumerate(inputs):
        field = f"inputs[{i}]"
        rest = None if binary is None else binary[declared:]
        if text is not None and isinstance(item, dict) and item.get("name") == text.input:
            texts, size = _decode_texts(item, field, rest, served, limits)
            if text.feeds in tensors or pending is not None:
                raise APIError(400, f"{field}.name: give {text.input!r} or {text.feeds!r}, not both")
            if limits is None:
                raise APIError(400, f"{field}: text input is not served here")
            first = next(iter(tensors.items()), None)
            if first is not None and len(texts) != len(first[1]):
                raise APIError(
                    400,
                    f"{field}.shape: input {text.input!r} has {len(texts)} rows but {first[0]!r} has {len(first[1])}",
                )
            pending = (texts, field)
            declared += size
            continue
        x, spec, size = _decode_input(item, field, rest, served, limits, regions, specs)
        if spec.name in tensors or (pending is not None and text is not None and spec.name == text.feeds):
            raise APIError(400, f"{field}.name: input {spec.name!r} is given twice")
        first = next(iter(tensors.items()), None)
        if first is not None and len(x) != len(first[1]):
            raise APIError(
                400, f"{field}.shape: input {spec.name!r} has {len(x)} rows but {first[0]!r} has {len(first[1])}"
            )
        if pending is not None and text is not None and len(x) != len(pending[0]):
            raise APIError(
                400, f"{field}.shape: input {spec.name!r} has {len(x)} rows but {text.input!r} has {len(pending[0])}"
            )
        tensors[spec.name] = x
        declared += size
    missing = [t.name for t in specs if t.name not in tensors and not (pending and text and t.name == text.feeds)]
    if missing:
        got = [t.name for t in specs if t.name in tensors]
        if text is not None and text.feeds in tensors and any(i.get("name") == text.input for i in inputs):
            got = [text.input if n == text.feeds else n for n in got]
        raise APIError(
            400,
            f"inputs: expected {len(specs)} inputs but got {len(got)} inputs for model {served.name!r}. Got input(s) "
            f"{_names(got)}, but missing required input(s) {_names(missing)}. Please provide all required input(s).",
        )
    if binary is not None and len(binary) != declared:
        raise APIError(
            400,
            f"body: {len(binary)} bytes follow the {HEADER_LENGTH} bytes of JSON, "
            f"but the inputs' binary_data_size declare {declared}",
        )
    rows = len(next(iter(tensors.values()))) if tensors else len(pending[0]) if pending else 0
    if len(served.manifest.outputs) > 1:
        wanted = _requested_outputs(payload, binary_output, served.manifest.outputs, regions, served.name)
        for spec in served.manifest.outputs:
            out = wanted.get(spec.name)
            if out is not None and out.span is not None:
                _check_room(out.span, spec, rows)
        return Inference(tensors, request_id, binary_output, timeout, outputs=wanted, texts=pending)
    out_spec = served.manifest.outputs[0]
    binary_output, classes, region = _requested_output(payload, binary_output, out_spec, regions, served.name)
    if region is not None:
        _check_room(region, out_spec, rows)  # checked before the forward: the output's size is known from the rows
    return Inference(tensors, request_id, binary_output, timeout, classes, region, texts=pending)


async def tokenize(req: Inference, served: ModelHandle, limits: Settings) -> Inference:
    """``req`` with its texts (if any) tokenized off the event loop into the inputs they feed
    (:func:`~server.api.codec.encode_texts`)."""
    if req.texts is not None:
        texts, field = req.texts
        req.inputs.update(await encode_texts(texts, field, served, limits.store, limits.max_text_bytes))
        req.texts = None
    return req


PLANS = 256
"""Request headers kept decoded (:class:`RequestPlan`), all models together: past it the oldest goes."""
PLAN_HEADER_BYTES = 4096
"""The longest JSON header kept decoded: a header carrying its tensors as JSON ``data`` is not worth keeping."""
PLAN_RESPONSES = 8
"""Response headers a plan keeps: one per precision and output shape its answers have had."""


@dataclass(frozen=True)
class _BinaryInput:
    spec: TensorSpec
    wire: WireType
    shape: list[int]
    start: int
    """Where its bytes start in the binary data."""
    size: int
    field: str


@dataclass
class RequestPlan:
    """What a V2 request's JSON header decides for a model, when every input comes as binary data: each input's
    spec, datatype, shape and bytes, and how the outputs go back; and the response's JSON header for each precision
    and output shape seen, when every output goes back as binary data.

    A client sends the same header with every request of a shape (only the binary data changes), so the inference
    route keeps plans by header (:func:`decode_request`) and a header it has seen is neither parsed nor checked again:
    only the data is (its size, dtype and values), and whatever the model's settings decide now (the request's size
    limit, the precision's input dtype). A plan holds for the manifest and settings it was made with, by identity.
    """

    manifest: Manifest
    limits: Settings
    inputs: tuple[_BinaryInput, ...]
    declared: int
    """The bytes of binary data the header declares."""
    request_id: str | None
    binary_output: bool
    timeout_us: int
    classes: int
    outputs: dict[str, OutputRequest] | None
    binary_outputs: tuple[tuple[str, WireType], ...]
    """Each output the request wants with its datatype, when all go back as binary data (else empty)."""
    responses: dict[tuple[object, ...], bytes]

    def holds(self, served: ModelHandle, limits: Settings, binary: memoryview | None) -> bool:
        return (
            self.manifest is served.manifest
            and self.limits is limits
            and binary is not None
            and len(binary) == self.declared
        )

    def request(self, binary: memoryview, served: ModelHandle) -> Inference:
        """The request of this header with ``binary``'s data (:meth:`holds` for them)."""
        tensors: dict[str, np.ndarray] = {}
        for i in self.inputs:
            check_size(self.limits, served, i.shape[0], f"{i.field}.shape")
            data = binary[i.start : i.start + i.size]
            arr = decode_binary(data, i.wire, i.shape, f"{i.field}.parameters.binary_data_size")
            tensors[i.spec.name] = _checked_input(arr, i.wire, i.spec, served, i.field, json=False)
        return Inference(
            tensors, self.request_id, self.binary_output, self.timeout_us, self.classes, None, self.outputs, self
        )


_plans: dict[tuple[str, int, bytes], RequestPlan] = {}


def _plan(payload: dict[str, Any], req: Inference, served: ModelHandle, limits: Settings) -> RequestPlan | None:
    """The plan of a header ``parse_request`` has accepted as ``req``; None when an input comes as JSON data, as
    text or from shared memory, or an output goes to shared memory, and for a header with an ``id`` (clients that
    send one send a new one with each request: a plan would cost each of them 3 us to make and never be used)."""
    outputs = req.outputs
    if (
        req.request_id is not None
        or req.output_span is not None
        or (outputs is not None and any(o.span is not None for o in outputs.values()))
    ):
        return None
    text = served.manifest.text
    specs = sent_inputs(served.manifest)
    inputs, start = [], 0
    for i, item in enumerate(payload["inputs"]):
        params = item.get("parameters", {})
        size = params.get("binary_data_size")
        if size is None or "shared_memory_region" in params or (text is not None and item["name"] == text.input):
            return None
        spec = next(t for t in specs if t.name == item["name"])
        wire = wire_type(item["datatype"], "")
        inputs.append(_BinaryInput(spec, wire, item["shape"], start, size, f"inputs[{i}]"))
        start += size
    m = served.manifest
    if outputs is None:
        wanted = [(m.outputs[0], OutputRequest(req.binary_output, req.classes))]
    else:
        wanted = [(spec, how) for spec in m.outputs if (how := outputs.get(spec.name)) is not None]
    binary_outputs: tuple[tuple[str, WireType], ...] = ()
    if all(how.binary and not how.classes for _, how in wanted):
        binary_outputs = tuple((spec.name, wire_type(spec.datatype.value, spec.name)) for spec, _ in wanted)
    return RequestPlan(
        m,
        limits,
        tuple(inputs),
        start,
        req.request_id,
        req.binary_output,
        req.timeout_us,
        req.classes,
        outputs,
        binary_outputs,
        {},
    )


async def decode_request(
    header: bytes, binary: memoryview | None, served: ModelHandle, limits: Settings, regions: RegionSource
) -> Inference:
    """The V2 inference request of ``header`` (its JSON) and ``binary``, from the plan kept for the header when there
    is one (:class:`RequestPlan`), else parsed and checked (:func:`parse_request`) and its plan kept."""
    key = (served.name, served.version, header)
    plan = _plans.get(key)
    if plan is not None and plan.holds(served, limits, binary):
        assert binary is not None
        return plan.request(binary, served)
    payload = await parse_json(header, limits.max_json_values)
    req = await tokenize(parse_request(payload, binary, served, limits, regions), served, limits)
    if len(header) <= PLAN_HEADER_BYTES:
        plan = _plan(payload, req, served, limits)
        if plan is not None:
            req.plan = plan
            _plans.pop(key, None)
            if len(_plans) >= PLANS:
                del _plans[next(iter(_plans))]
            _plans[key] = plan
    return req


def _decode_texts(
    item: dict[str, Any], field: str, binary: memoryview | None, served: ModelHandle, limits: Settings | None
) -> tuple[Sequence[bytes | str], int]:
    """A ``BYTES`` input of texts (shape ``[N]`` or ``[N, 1]``), from JSON strings or binary data, and the bytes of
    ``binary`` it took."""
    if item.get("datatype") != "BYTES":
        raise APIError(400, f"{field}.datatype: text input {item.get('name')!r} is BYTES, got {item.get('datatype')!r}")
    shape = item.get("shape")
    if not (isinstance(shape, list) and shape and all(type(d) is int for d in shape) and shape[1:] in ([], [1])):
        raise APIError(400, f"{field}.shape: expected [N] or [N, 1] (one text per row), got {shape!r}")
    rows = shape[0]
    if rows < 1:
        raise APIError(400, f"{field}.shape: the batch dimension must be at least 1, got {rows}")
    if limits is not None:
        check_size(limits, served, rows, f"{field}.shape")
    params = _params(item, f"{field}.parameters")
    size = params.get("binary_data_size")
    if size is None:
        data = item.get("data")
        if not isinstance(data, list) or len(data) != rows or not all(isinstance(t, str) for t in data):
            raise APIError(400, f"{field}.data: expected {rows} strings, one text per row")
        return data, 0
    size = count(size, f"{field}.parameters.binary_data_size", "a byte count")
    if binary is None or size > len(binary):
        raise APIError(400, f"{field}.parameters.binary_data_size: {size} bytes declared, not in the body")
    texts, at, raw = [], 0, bytes(binary[:size])
    while at < size:
        if at + 4 > size:
            raise APIError(400, f"{field}: binary BYTES data ends inside an element's 4-byte length")
        n = int.from_bytes(raw[at : at + 4], "little")
        if at + 4 + n > size:
            raise APIError(400, f"{field}: a BYTES element of {n} bytes runs past the input's binary_data_size")
        texts.append(raw[at + 4 : at + 4 + n])
        at += 4 + n
        if len(texts) > rows:  # stop at once: a body of empty elements would otherwise be parsed to its end
            break
    if len(texts) != rows:
        raise APIError(400, f"{field}: {len(texts)} BYTES elements, but shape {shape} holds {rows}")
    return texts, size


def _check_room(region: Span, spec: TensorSpec, rows: int) -> None:
    wire = wire_type(spec.datatype.value, spec.name)
    need = rows * element_count(spec.shape) * wire.dtype.itemsize
    if need > region.size:
        raise APIError(
            400,
            f"outputs[0].parameters.shared_memory_byte_size: {region.size} bytes cannot hold the output "
            f"{spec.name!r} ({need} bytes for {rows} rows)",
        )


def parse_raw(binary: memoryview, served: ModelHandle, limits: Settings | None = None) -> Inference:
    """A raw binary request (``Inference-Header-Content-Length: 0``): the whole body is the single input's data.

    Its datatype is the manifest's. Since every per-sample dimension is fixed, the batch size follows from the byte
    count: any whole number of samples is accepted (Triton takes exactly one). Outputs are returned as binary.
    """
    if len(served.manifest.inputs) > 1 or served.manifest.inputs[0].variable:
        names = [t.name for t in served.manifest.inputs]
        raise APIError(
            400,
            f"body: a raw binary request ({HEADER_LENGTH}: 0) feeds a model with one fixed-shape input; this one "
            f"takes {names}",
        )
    spec = served.manifest.inputs[0]
    wire = wire_type(spec.datatype.value, spec.name)
    sample = element_count(spec.shape) * wire.dtype.itemsize
    if not binary or len(binary) % sample:
        raise APIError(
            400,
            f"body: a raw binary request ({HEADER_LENGTH}: 0) must hold whole samples of {spec.name!r} "
            f"({spec.datatype.value} {spec.shape}: {sample} bytes each), got {len(binary)} bytes",
        )
    shape = [len(binary) // sample, *spec.shape]
    if limits is not None:
        check_size(limits, served, shape[0], "body")
    arr = decode_binary(binary, wire, shape, "body")
    fp16_weights = served.precision is Precision.FP16
    x = to_input_dtype(arr, wire, spec, fp16_weights, "body", served.name)
    check_finite(x, served, "body")
    return Inference({spec.name: x}, None, True)


def top_classes(out: np.ndarray, wire: WireType, count: int, labels: list[str] | None) -> list[list[str]]:
    """Per row, the ``count`` highest values of the output (every value, where it has fewer) as Triton's
    classification extension writes them: ``"<value>:<index>"``, then ``":<label>"`` when the manifest's labels
    name the output's values.

    Values are compared and written as the output's datatype carries them (an FP16 output's rounded values; integers
    as integers); ties go to the lower index.
    """
    values = wire_values(out, wire)
    if wire is WireType.BF16:
        values = (values.astype(np.uint32) << 16).view(np.float32)
    values = values.reshape(len(out), -1)
    order = np.argsort(-values.astype(np.float64), axis=1, kind="stable")[:, :count]
    named = labels if labels is not None and len(labels) == values.shape[1] else None
    rows = []
    for row, idx in zip(values, order, strict=True):
        texts = [f"{row[i]:f}:{i}" if wire.is_float else f"{int(row[i])}:{i}" for i in idx]
        rows.append([f"{t}:{named[i]}" for t, i in zip(texts, idx, strict=True)] if named else texts)
    return rows


def encode_response(served: ModelHandle, req: Inference, result: Prediction) -> Response:
    """The V2 inference response: JSON, or JSON followed by the output's binary data.

    JSON cannot carry non-finite numbers: an infinite or NaN output (overflow policy ``allow``) is written as
    ``null`` in JSON ``data``; binary outputs carry it exactly.
    """
    plan = req.plan
    key: tuple[object, ...] = ()
    if plan is not None and plan.binary_outputs:
        key = (result.precision, *(result.outputs[name].shape for name, _ in plan.binary_outputs))
        body = plan.responses.get(key)
        if body is not None:
            tail = b"".join(encode_binary(result.outputs[name], wire) for name, wire in plan.binary_outputs)
            return _binary_response(body, tail)
    outputs, tails = [], []
    for output, tail in encode_outputs(served, req, result):
        outputs.append(output)
        tails.append(tail)
    header: dict[str, Any] = {"model_name": served.name, "model_version": str(served.version)}
    if req.request_id is not None:
        header["id"] = req.request_id
    header["parameters"] = {"precision": result.precision}
    header["outputs"] = outputs
    body = orjson.dumps(header, option=orjson.OPT_SERIALIZE_NUMPY)
    tail = b"".join(tails)
    if not tail:
        return Response(body, media_type="application/json")
    if plan is not None and key and len(plan.responses) < PLAN_RESPONSES:
        plan.responses[key] = body
    return _binary_response(body, tail)


def _binary_response(header: bytes, tail: bytes) -> Response:
    response = Response(header + tail, media_type="application/octet-stream")
    response.raw_headers.append((_HEADER_LENGTH_KEY, b"%d" % len(header)))
    return response


def encode_outputs(served: ModelHandle, req: Inference, result: Prediction) -> list[tuple[dict[str, Any], bytes]]:
    """The outputs ``req`` asks for, in the manifest's order: each one's entry in the response and its binary data
    (empty when it goes as JSON or to shared memory)."""
    if req.outputs is None:
        spec = served.manifest.outputs[0]
        wanted = {spec.name: OutputRequest(req.binary_output, req.classes, req.output_span)}
    else:
        wanted = req.outputs
    return [
        _encode_output(served, spec, result.outputs[spec.name], how)
        for spec in served.manifest.outputs
        if (how := wanted.get(spec.name)) is not None
    ]


def _encode_output(
    served: ModelHandle, spec: TensorSpec, out: np.ndarray, how: OutputRequest
) -> tuple[dict[str, Any], bytes]:
    """One output's entry in the response, and its binary data (empty when it goes as JSON or to shared memory)."""
    wire = wire_type(spec.datatype.value, spec.name)
    output: dict[str, Any] = {"name": spec.name, "datatype": wire.value, "shape": list(out.shape)}
    tail = b""
    if how.span is not None:
        data = wire_values(out, wire).reshape(-1).view(np.uint8)
        how.span.write(data.data)
        name = how.span.region.name
        output["parameters"] = {"shared_memory_region": name, "shared_memory_byte_size": len(data)}
    elif how.classes:
        labels = served.manifest.labels if spec is served.manifest.outputs[0] else None
        classes = top_classes(out, wire, how.classes, labels)
        output |= {"datatype": "BYTES", "shape": [len(classes), len(classes[0])]}
        flat = [c for row in classes for c in row]
        if how.binary:
            tail = encode_bytes([c.encode() for c in flat])
            output["parameters"] = {"binary_data_size": len(tail)}
        else:
            output["data"] = flat
    elif how.binary:
        tail = encode_binary(out, wire)
        output["parameters"] = {"binary_data_size": len(tail)}
    else:
        output["data"] = wire_values(out, wire).reshape(-1)
    return output, tail


@metered(Interface.V2)
async def infer(request: Request) -> Response:
    """``POST /v2/models/{model_name}[/versions/{model_version}]/infer``, as a plain Starlette endpoint."""
    guard.content_type(request.scope, guard.JSON_OR_BINARY)
    app = deps.state(request)
    version = version_of(request)
    served = served_model(request, request.path_params["model_name"], version)
    note(request, served)
    check_ready(served, version)
    limits = app.settings
    timeout = client_timeout(request)
    body = await read_body(request, limits.max_body_bytes)
    length = raw_header(request, _HEADER_LENGTH_KEY)
    header, binary = split_body(body, None if length is None else length.decode("latin-1"))
    if header is not None:
        req = await decode_request(header, binary, served, limits, partial(authorised_regions, request))
    else:
        assert binary is not None
        if (raw_header(request, b"content-type") or b"").startswith(b"application/json"):
            # Read as raw tensor bytes, a JSON body whose length happens to be whole samples would be served garbage.
            raise APIError(
                400,
                f"{HEADER_LENGTH}: 0 announces a raw binary body, but Content-Type is application/json; "
                "send raw tensor data as application/octet-stream",
            )
        req = parse_raw(binary, served, limits)
    try:
        result = await served.submit(req.inputs, req.timeout(timeout))
        answered(request, result)
    except asyncio.CancelledError:
        if not app.draining:
            raise
        raise cut_off_by_shutdown() from None
    except Exception as e:
        raise from_exception(e) from None
    return encode_response(served, req, result)


@model_route(router, "POST", "/infer", openapi_extra=INFER_SCHEMA)
async def model_infer(model_name: str, request: Request) -> Response:
    """Run an inference request; concurrent requests (V2 and ``/predict``) are batched together. (Answered by
    :func:`infer` ahead of FastAPI: this declaration gives the schema.)"""
    return await infer(request)
