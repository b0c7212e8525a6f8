"""One signature rule for every protocol: the same input spec refuses the same wrong shape, the same over-long or empty
variable length and the same too many rows through ``/predict``'s decoder, the V2 JSON decoder and the gRPC decoder,
each naming its own field; and gRPC reads its message into the data plane's typed request, not into a V2 JSON dict."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

import numpy as np
import orjson
import pytest

from halfserve import grpc_messages as pb
from halfserve.api.dataplane.decode import decode
from halfserve.api.dataplane.json_request import read_request
from halfserve.api.dataplane.request import BinaryData, InferRequest, RequestInput, SharedMemory, Texts
from halfserve.api.dataplane.samples import decode_inputs
from halfserve.api.grpc.grpc_codec import infer_request
from halfserve.errors import InvalidInputError, OverLimitError, ServingError
from halfserve.execution import Batching
from halfserve.manifest import DataType, Manifest, Precision, TensorSpec
from halfserve.serving import ModelHandle
from halfserve.settings import Settings

MAX_LENGTH = 8
SETTINGS = Settings(max_request_rows=4)


def handle(*specs: TensorSpec) -> ModelHandle:
    manifest = Manifest(
        name="m",
        architecture="mlp",
        inputs=list(specs),
        outputs=[TensorSpec(name="logits", shape=[4])],
        batching=Batching(max_batch_size=16),
    )
    served = SimpleNamespace(
        name="m", version=1, manifest=manifest, batching=manifest.batching, precision=Precision.FP32
    )
    return cast(ModelHandle, served)


FIXED = TensorSpec(name="features", shape=[16])
VARIABLE = TensorSpec(name="tokens", datatype=DataType.INT64, shape=[-1], max_length=MAX_LENGTH, pad=0)


async def via_predict(served: ModelHandle, x: np.ndarray) -> None:
    await decode_inputs(x.tolist(), served, SETTINGS)


async def via_v2_json(served: ModelHandle, x: np.ndarray) -> None:
    spec = served.manifest.inputs[0]
    header = {"inputs": [{"name": spec.name, "datatype": spec.datatype.value, "shape": list(x.shape)}]}
    header["inputs"][0]["parameters"] = {"binary_data_size": x.nbytes}
    payload = orjson.loads(orjson.dumps(header))
    decode(read_request(payload, memoryview(x.tobytes()), served), served, SETTINGS)


async def via_grpc(served: ModelHandle, x: np.ndarray) -> None:
    spec = served.manifest.inputs[0]
    message = pb.ModelInferRequest(model_name="m")
    message.inputs.add(name=spec.name, datatype=spec.datatype.value, shape=list(x.shape))
    message.raw_input_contents.append(x.tobytes())
    decode(await infer_request(message, served, SETTINGS), served, SETTINGS)


DECODERS = {
    "predict": (via_predict, "inputs: "),
    "v2": (via_v2_json, "inputs[0].shape: "),
    "grpc": (via_grpc, "inputs[0].shape: "),
}

CASES: list[tuple[str, TensorSpec, np.ndarray, type[ServingError], str]] = [
    ("wrong shape", FIXED, np.zeros((1, 3), np.float32), InvalidInputError, "shape"),
    ("too long", VARIABLE, np.zeros((1, MAX_LENGTH + 1), np.int64), InvalidInputError, "longer than its max_length 8"),
    ("no length", VARIABLE, np.zeros((1, 0), np.int64), InvalidInputError, "at least 1"),
    ("too many rows", FIXED, np.zeros((5, 16), np.float32), OverLimitError, "5 rows exceed the limit of 4"),
]


@pytest.mark.parametrize("protocol", DECODERS)
@pytest.mark.parametrize(("case", "spec", "x", "error", "says"), CASES, ids=[c[0] for c in CASES])
async def test_every_protocol_keeps_one_signature_rule_naming_its_own_field(
    protocol: str, case: str, spec: TensorSpec, x: np.ndarray, error: type[ServingError], says: str
) -> None:
    decoder, field = DECODERS[protocol]
    with pytest.raises(error) as refused:
        await decoder(handle(spec), x)
    message = str(refused.value)
    assert message.startswith(field), (case, message)
    assert says in message, (case, message)


@pytest.mark.parametrize("protocol", DECODERS)
async def test_every_protocol_takes_what_the_rule_allows(protocol: str) -> None:
    decoder, _ = DECODERS[protocol]
    await decoder(handle(FIXED), np.zeros((4, 16), np.float32))
    await decoder(handle(VARIABLE), np.ones((2, MAX_LENGTH), np.int64))


async def test_grpc_reads_each_input_into_a_typed_request_with_its_own_bytes() -> None:
    """No V2 JSON dict and no joined binary data: each input keeps its own entry of raw_input_contents (or its typed
    contents, or its BYTES elements), and no binary_data_size is made up for it."""
    served = handle(FIXED, TensorSpec(name="other", shape=[2]))
    message = pb.ModelInferRequest(model_name="m", id="r1")
    first = np.arange(16, dtype=np.float32).reshape(1, 16)
    message.inputs.add(name="features", datatype="FP32", shape=[1, 16])
    message.inputs.add(name="other", datatype="FP32", shape=[1, 2])
    message.raw_input_contents.extend([first.tobytes(), b"\x00" * 8])
    request = await infer_request(message, served, SETTINGS)
    assert isinstance(request, InferRequest)
    assert request.id == "r1"
    assert [type(i) for i in request.inputs] == [RequestInput, RequestInput]
    views = [i.data for i in request.inputs]
    assert all(isinstance(v, BinaryData) for v in views)
    assert [bytes(cast(BinaryData, v).view) for v in views] == [first.tobytes(), b"\x00" * 8]
    assert all("binary_data_size" not in i.parameters for i in request.inputs)

    typed = pb.ModelInferRequest(model_name="m")
    texts = typed.inputs.add(name="text", datatype="BYTES", shape=[2])
    texts.contents.bytes_contents.extend([b"a", b"bc"])
    region = typed.inputs.add(name="features", datatype="FP32", shape=[1, 16])
    region.parameters["shared_memory_region"].string_param = "r"
    region.parameters["shared_memory_byte_size"].int64_param = 64
    read: Any = await infer_request(typed, served, SETTINGS)
    assert read.inputs[0].data == Texts([b"a", b"bc"])
    assert isinstance(read.inputs[1].data, SharedMemory)
