"""What the server and each model say about themselves over the V2 protocol, HTTP and gRPC alike."""

from __future__ import annotations

import json
from typing import Any

from halfserve.manifest import TensorSpec, bytes_input, sent_inputs
from halfserve.serving import ModelHandle

SERVER_NAME = "halfserve"
PLATFORM = "pytorch_libtorch"
EXTENSIONS = [
    "binary_tensor_data",
    "classification",
    "model_configuration",
    "statistics",
    "model_repository",
    "system_shared_memory",
]


def tensor_metadata(spec: TensorSpec) -> dict[str, object]:
    return {"name": spec.name, "datatype": spec.datatype.value, "shape": [-1, *spec.wire_shape]}


def metadata(served: ModelHandle) -> dict[str, Any]:
    """The protocol's model metadata of ``served``: versions, platform, and each input and output with its datatype
    and shape (batch first, as -1); the inputs are those a client sends, a text or photo model's ``BYTES`` input
    among them."""
    m = served.manifest
    sent = bytes_input(m)
    return {
        "name": served.name,
        "versions": [str(served.version)],
        "platform": PLATFORM,
        "inputs": [tensor_metadata(s) for s in sent_inputs(m)]
        + ([{"name": sent, "datatype": "BYTES", "shape": [-1, 1]}] if sent is not None else []),
        "outputs": [tensor_metadata(s) for s in m.outputs],
        "parameters": parameters(served),
    }


def parameters(served: ModelHandle) -> dict[str, str]:
    """The metadata's ``parameters``: the precision served and its record (JSON text, as the protocol's parameter
    values are scalars; empty where the precision was not measured), so a client can see what it is served."""
    record = served.precision_record
    return {
        "precision": served.precision.value if served.precision is not None else "",
        "precision_record": json.dumps(record, separators=(",", ":")) if record is not None else "",
    }
