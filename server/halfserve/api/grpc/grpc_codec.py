"""The two ends of a V2 inference over gRPC: a ``ModelInferRequest`` in, a ``ModelInferResponse`` out.

A request is read into the data plane's typed request (:class:`~halfserve.api.dataplane.request.InferRequest`), as
an HTTP request is, and decoded by the same :func:`~halfserve.api.dataplane.decode.decode`, so both protocols share
one set of rules, limits and error messages: each input's data is its own ``raw_input_contents`` entry as it is (no
copy), its typed ``contents`` converted once with numpy, or its BYTES elements as they are. FP16 and BF16 have no
typed field: they travel in ``raw_input_contents`` only, as the protocol says. Outputs always leave in
``raw_output_contents`` (one entry per output, in order; empty for one written to shared memory), which is what Triton
sends and what ``tritonclient.grpc`` reads first.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

from halfserve import grpc_messages as pb
from halfserve.api.dataplane.bounds import check_size
from halfserve.api.dataplane.codec import check_range, element_count
from halfserve.api.dataplane.decode import check_input_count
from halfserve.api.dataplane.encode import encode_outputs
from halfserve.api.dataplane.request import (
    SHARED_MEMORY,
    BinaryData,
    Inference,
    InferRequest,
    InputData,
    RequestInput,
    RequestOutput,
    Texts,
)
from halfserve.errors import InvalidInputError
from halfserve.manifest import DataType
from halfserve.serving import ModelHandle, Prediction
from halfserve.settings import Settings

_TYPED_FIELDS: dict[str, tuple[str, np.dtype[Any]]] = {
    "BOOL": ("bool_contents", np.dtype("?")),
    "INT8": ("int_contents", np.dtype("<i4")),
    "INT16": ("int_contents", np.dtype("<i4")),
    "INT32": ("int_contents", np.dtype("<i4")),
    "INT64": ("int64_contents", np.dtype("<i8")),
    "UINT8": ("uint_contents", np.dtype("<u4")),
    "UINT16": ("uint_contents", np.dtype("<u4")),
    "UINT32": ("uint_contents", np.dtype("<u4")),
    "UINT64": ("uint64_contents", np.dtype("<u8")),
    "FP32": ("fp32_contents", np.dtype("<f4")),
    "FP64": ("fp64_contents", np.dtype("<f8")),
}
"""The typed ``contents`` field of each datatype, and the dtype its values arrive in (INT8 and INT16 share the
32-bit field, range-checked when narrowed)."""


def parameters(params: Any) -> dict[str, Any]:
    """A ``map<string, InferParameter>`` as plain values."""
    out: dict[str, Any] = {}
    for key, p in params.items():
        which = p.WhichOneof("parameter_choice")
        out[key] = getattr(p, which) if which is not None else None
    return out


def set_parameters(target: Any, params: dict[str, Any]) -> None:
    """Fill a ``map<string, InferParameter>`` from plain values."""
    for key, value in params.items():
        p = target[key]
        if isinstance(value, bool):
            p.bool_param = value
        elif isinstance(value, int):
            p.int64_param = value
        elif isinstance(value, float):
            p.double_param = value
        else:
            p.string_param = str(value)


INLINE_VALUES = 1 << 14
"""Values of typed ``contents`` converted on the event loop; more in a worker thread (every BYTES entry becomes a
Python object, and two million empty ones took the loop 1.4 s)."""


async def infer_request(request: Any, served: ModelHandle, settings: Settings) -> InferRequest:
    """``request`` as the data plane's :class:`~halfserve.api.dataplane.request.InferRequest` for ``served``. Every
    input's rows are checked against what a request may carry before any data is converted, and many typed values
    are converted in a worker thread."""
    check_input_count(len(request.inputs), served)
    for i, tensor in enumerate(request.inputs):
        if len(tensor.shape) and tensor.shape[0] >= 1:  # a batch dimension under 1 is the shape check's to name
            check_size(settings, served, tensor.shape[0], f"inputs[{i}].shape")
    if _typed_values(request) <= INLINE_VALUES:
        return _request(request)
    return await asyncio.to_thread(_request, request)


def _typed_values(request: Any) -> int:
    """Values the inputs' typed ``contents`` hold, in the field each input's datatype reads."""
    total = 0
    for tensor in request.inputs:
        if not tensor.HasField("contents"):
            continue
        typed = _TYPED_FIELDS.get(tensor.datatype)
        if tensor.datatype == "BYTES":
            total += len(tensor.contents.bytes_contents)
        elif typed is not None:
            total += len(getattr(tensor.contents, typed[0]))
    return total


def _request(request: Any) -> InferRequest:
    raw = request.raw_input_contents
    inputs: list[RequestInput] = []
    taken = 0
    for i, tensor in enumerate(request.inputs):
        field = f"inputs[{i}]"
        params = parameters(tensor.parameters)
        params.pop("binary_data_size", None)  # each input's bytes are its own entry: a declared size means nothing
        data: InputData
        if "shared_memory_region" in params:
            data = SHARED_MEMORY
        elif len(raw):
            if tensor.HasField("contents"):
                raise InvalidInputError(
                    f"{field}.contents: give the data of every input in raw_input_contents, or none there"
                )
            if taken >= len(raw):
                raise InvalidInputError(f"raw_input_contents: {len(raw)} entries, but input {i} needs one too")
            data = BinaryData(memoryview(raw[taken]), f"raw_input_contents[{taken}]")
            taken += 1
        else:
            data = _typed_data(tensor, field)
        inputs.append(RequestInput(tensor.name, tensor.datatype, list(tensor.shape), params, data))
    if taken != len(raw):
        raise InvalidInputError(f"raw_input_contents: {len(raw)} entries for {taken} inputs that take data from it")
    # Every output leaves in raw_output_contents, whatever a client asks: gRPC has no JSON form of a tensor.
    outputs = [RequestOutput(o.name, {**parameters(o.parameters), "binary_data": True}) for o in request.outputs]
    params = {**parameters(request.parameters), "binary_data_output": True}
    return InferRequest(request.id or None, params, inputs, outputs or None)


def _typed_data(tensor: Any, field: str) -> InputData:
    """An input's typed ``contents``: BYTES elements, or the binary data of its datatype."""
    contents = tensor.contents
    # Python's integers, not numpy's: a shape of huge dimensions must not wrap around to a small count. A shape of no
    # dimensions holds one value, as over HTTP, so the decoder judges it as it judges HTTP's (it has no batch dim).
    want = element_count(list(tensor.shape))
    if tensor.datatype == "BYTES":
        entries = contents.bytes_contents
        if len(entries) != want:  # counted before a bytes object is made for each
            shape = list(tensor.shape)
            raise InvalidInputError(
                f"{field}.contents.bytes_contents: {len(entries)} values, but shape {shape} holds {want}"
            )
        return Texts(list(entries))
    typed = _TYPED_FIELDS.get(tensor.datatype)
    if typed is None:
        if tensor.datatype in (DataType.FP16.value, DataType.BF16.value):
            raise InvalidInputError(
                f"{field}: {tensor.datatype} data travels in raw_input_contents only (no contents field holds it)"
            )
        return BinaryData(memoryview(b""))  # an unknown datatype: the decoder names it
    name, dtype = typed
    values = getattr(contents, name)
    if len(values) != want:
        shape = list(tensor.shape)
        given = [f.name for f, _ in contents.ListFields() if f.name != name]
        if not values and given:  # values in another datatype's field: say which field this datatype reads
            raise InvalidInputError(
                f"{field}.contents: {', '.join(given)} given, but a {tensor.datatype} input reads {name}",
            )
        raise InvalidInputError(f"{field}.contents.{name}: {len(values)} values, but shape {shape} holds {want}")
    arr = np.asarray(values, dtype=dtype)
    wire = DataType(tensor.datatype)
    if wire.wire_dtype != dtype:
        check_range(arr, wire.wire_dtype, f"{field}.contents.{name}")
    return BinaryData(memoryview(arr.astype(wire.wire_dtype, copy=False).tobytes()), f"{field}.contents.{name}")


def infer_response(served: ModelHandle, req: Inference, result: Prediction) -> Any:
    """The ``ModelInferResponse`` for ``req``: every output's data in ``raw_output_contents``."""
    response = pb.ModelInferResponse(model_name=served.name, model_version=str(served.version))
    if req.request_id is not None:
        response.id = req.request_id
    response.parameters["precision"].string_param = result.precision
    for output, tail in encode_outputs(served, req, result):
        tensor = response.outputs.add(name=output["name"], datatype=output["datatype"], shape=output["shape"])
        params = {k: v for k, v in output.get("parameters", {}).items() if k != "binary_data_size"}
        set_parameters(tensor.parameters, params)
        response.raw_output_contents.append(tail)
    return response
