"""gRPC's refusals name gRPC's fields: ``model_name``, ``raw_input_contents[k]``, the ``contents`` field a datatype
reads; never HTTP's ``model`` or ``parameters.binary_data_size``, which a gRPC client cannot send (issue 3)."""

from __future__ import annotations

import struct
from pathlib import Path

import grpc
import pytest
from tritonclient.grpc import service_pb2

from halfserve.settings import Settings
from tests.conftest import free_port, save_tiny_mlp
from tests.integration.conftest import serving

INFER = "/inference.GRPCInferenceService/ModelInfer"


def _request(model: str) -> service_pb2.ModelInferRequest:
    return service_pb2.ModelInferRequest(model_name=model)


def _short_raw() -> service_pb2.ModelInferRequest:
    request = _request("tiny")
    request.inputs.add(name="features", datatype="FP32", shape=[1, 16])
    request.raw_input_contents.append(b"\0" * 60)  # 4 bytes short of 16 floats
    return request


def _ints_for_floats() -> service_pb2.ModelInferRequest:
    request = _request("tiny")
    request.inputs.add(name="features", datatype="FP32", shape=[1, 16]).contents.int_contents.extend([1] * 16)
    return request


_NAN_ROW = [1.0, float("nan")] + [0.0] * 14


def _nan_raw() -> service_pb2.ModelInferRequest:
    request = _request("tiny")
    request.inputs.add(name="features", datatype="FP32", shape=[1, 16])
    request.raw_input_contents.append(struct.pack("<16f", *_NAN_ROW))
    return request


def _nan_contents() -> service_pb2.ModelInferRequest:
    request = _request("tiny")
    request.inputs.add(name="features", datatype="FP32", shape=[1, 16]).contents.fp32_contents.extend(_NAN_ROW)
    return request


_NAN = "row 0 holds a NaN or infinite value (or one beyond the range of float32); model 'tiny' does not accept them"


def _timeout_past_an_hour() -> service_pb2.ModelInferRequest:
    request = _request("tiny")
    request.inputs.add(name="features", datatype="FP32", shape=[1, 16]).contents.fp32_contents.extend([1.0] * 16)
    request.parameters["timeout"].int64_param = 3_600_000_001
    return request


def _no_model_name() -> service_pb2.ModelInferRequest:
    request = _request("")
    request.inputs.add(name="features", datatype="FP32", shape=[1, 16]).contents.fp32_contents.extend([1.0] * 16)
    return request


@pytest.mark.parametrize(
    ("message", "error"),
    [
        (_short_raw, "raw_input_contents[0]: 60 bytes of binary data, but shape [1, 16] of FP32 takes 64 bytes"),
        (_ints_for_floats, "inputs[0].contents: int_contents given, but a FP32 input reads fp32_contents"),
        (_no_model_name, "model_name: several models are served (other, tiny); name one in model_name"),
        # Both were named "inputs[0] (binary data)", HTTP's words for the bytes after its JSON header.
        (_nan_raw, f"raw_input_contents[0]: {_NAN} (allow_nonfinite_inputs)"),
        (_nan_contents, f"inputs[0].contents.fp32_contents: {_NAN} (allow_nonfinite_inputs)"),
        # As over HTTP, and as its X-Request-Timeout-Ms header: at most an hour (2^63 - 1 microseconds was taken).
        (_timeout_past_an_hour, "parameters.timeout: expected microseconds in [0, 3600000000], got 3600000001"),
    ],
    ids=["short-raw", "ints-for-floats", "no-model-name", "nan-raw", "nan-contents", "timeout"],
)
async def test_a_refusal_names_the_grpc_field(tiny_store: Path, message: object, error: str) -> None:
    assert callable(message)
    save_tiny_mlp(tiny_store, "other")
    port = free_port()
    settings = Settings(store=tiny_store, precision="fp32", grpc=True, grpc_port=port, host="127.0.0.1")
    async with serving(settings), grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        infer = channel.unary_unary(INFER, request_serializer=service_pb2.ModelInferRequest.SerializeToString)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await infer(message(), timeout=20)
        assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details() == error
