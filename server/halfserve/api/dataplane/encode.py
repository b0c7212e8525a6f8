"""A prediction as the V2 response's parts: each requested output's entry (datatype, shape, and its data as JSON or
its parameters) and its binary data, in the manifest's order; as top classes (the classification extension) or
written into shared memory where the request asked.

JSON cannot carry non-finite numbers: an infinite or NaN output (overflow policy ``allow``) is written as ``null`` in
JSON ``data``; binary outputs carry it exactly.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import orjson

from halfserve.api.dataplane.codec import encode_binary, encode_bytes, wire_values
from halfserve.api.dataplane.request import PLAN_RESPONSES, Inference, OutputRequest
from halfserve.manifest import DataType, TensorSpec
from halfserve.serving import ModelHandle, Prediction


def top_classes(out: np.ndarray, wire: DataType, count: int, labels: list[str] | None) -> list[list[str]]:
    """Per row, the ``count`` highest values of the output (every value, where it has fewer) as Triton's
    classification extension writes them: ``"<value>:<index>"``, then ``":<label>"`` when the manifest's labels
    name the output's values.

    Values are compared and written as the output's datatype carries them (an FP16 output's rounded values; integers
    as integers); ties go to the lower index.
    """
    values = wire_values(out, wire)
    if wire is DataType.BF16:
        values = (values.astype(np.uint32) << 16).view(np.float32)
    values = values.reshape(len(out), -1)
    order = np.argsort(-values.astype(np.float64), axis=1, kind="stable")[:, :count]
    named = labels if labels is not None and len(labels) == values.shape[1] else None
    rows = []
    for row, idx in zip(values, order, strict=True):
        texts = [f"{row[i]:f}:{i}" if wire.is_float else f"{int(row[i])}:{i}" for i in idx]
        rows.append([f"{t}:{named[i]}" for t, i in zip(texts, idx, strict=True)] if named else texts)
    return rows


def encode_response(served: ModelHandle, req: Inference, result: Prediction) -> tuple[bytes, bytes]:
    """The V2 inference response's JSON header and the binary data that follows it (empty when every output went as
    JSON or to shared memory: the response is then the JSON alone)."""
    plan = req.plan
    key: tuple[object, ...] = ()
    if plan is not None and plan.binary_outputs:
        key = (result.precision, *(result.outputs[name].shape for name, _ in plan.binary_outputs))
        body = plan.responses.get(key)
        if body is not None:
            return body, b"".join(encode_binary(result.outputs[name], wire) for name, wire in plan.binary_outputs)
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
    if tail and plan is not None and key and len(plan.responses) < PLAN_RESPONSES:
        plan.responses[key] = body
    return body, tail


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
    wire = spec.datatype
    shape = list(out.shape) if spec.shape else [len(out), *spec.wire_shape]  # one value per row: [B, 1]
    output: dict[str, Any] = {"name": spec.name, "datatype": wire.value, "shape": shape}
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
