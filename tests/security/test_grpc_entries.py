"""What a ``ModelInferRequest`` may hold, counted before it is parsed or converted: protobuf merges every occurrence of
an input's ``contents`` into one, so a second is refused rather than left uncounted; an input holds no more values than
the model named takes in a request (its most rows of its values per row), whatever its declared shape claims; and an
input's rows are checked before any of its data is converted. Each is a clear refusal while the server serves on."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from tritonclient.grpc import service_pb2

from tests.security.test_grpc_abuse import MODEL, Endpoint, StartServer, healthy, refusal, serve

pytestmark = pytest.mark.slow

_LEN = 2


@pytest.fixture(scope="module")
def endpoint(server_factory: StartServer, served_tiny_store: Path) -> Endpoint:
    return serve(server_factory, served_tiny_store)


def _field(number: int, value: bytes) -> bytes:
    """One length-delimited field of a protobuf encoding."""
    n, length = len(value), b""
    while n >= 0x80:
        length += bytes([n & 0x7F | 0x80])
        n >>= 7
    return bytes([number << 3 | _LEN]) + length + bytes([n]) + value


def test_an_input_s_contents_given_twice_is_refused_before_it_is_parsed(endpoint: Endpoint) -> None:
    # 10,000 contents of one empty entry each (40 KB, under the message cap) for a shape of one value: merged by the
    # parser into 10,000 entries, while each occurrence alone holds what the shape does.
    tensor = service_pb2.ModelInferRequest.InferInputTensor(name="features", datatype="BYTES", shape=[1])
    one = service_pb2.InferTensorContents(bytes_contents=[b""]).SerializeToString()
    encoded = tensor.SerializeToString() + _field(5, one) * 10_000
    raw = _field(1, MODEL.encode()) + _field(5, encoded)
    e = refusal(endpoint.address, raw)
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "inputs[0].contents: given more than once" in str(e.details())
    healthy(endpoint)


def test_an_input_holds_no_more_values_than_the_model_takes_in_a_request(endpoint: Endpoint) -> None:
    # The tiny model takes 8 rows of 16 values; a declared shape of 30,000 rows of empty BYTES entries (60 KB) stays
    # under max_request_elements, and was parsed into 30,000 objects.
    request = service_pb2.ModelInferRequest(model_name="")  # model_name last: it is read first wherever it is
    tensor = request.inputs.add(name="features", datatype="BYTES", shape=[30_000])
    tensor.contents.bytes_contents.extend([b""] * 30_000)
    raw = request.SerializeToString() + _field(1, MODEL.encode())
    e = refusal(endpoint.address, raw)
    assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert (
        "inputs[0].contents.bytes_contents: more values than the limit of 128 per request "
        "(model 'tiny': 8 rows (the model's max_batch_size; max_request_rows) of 16 values)"
    ) in str(e.details())
    healthy(endpoint)


def test_an_input_s_rows_are_checked_before_its_data_is_converted(endpoint: Endpoint) -> None:
    request = service_pb2.ModelInferRequest(model_name=MODEL)
    request.inputs.add(name="features", datatype="FP32", shape=[30_000, 16]).contents.fp32_contents.extend([1.0] * 64)
    e = refusal(endpoint.address, request)
    assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "inputs[0].shape: 30000 rows exceed the limit of 8 per request" in str(e.details())
    healthy(endpoint)
