"""What a refused gRPC call leaves behind: nothing. A refusal's traceback holds the frames that handled the call, and
they hold its request message; an error kept in one of those frames after its ``except`` makes a cycle that only a
full garbage collection frees, so every refused message stayed in memory until one ran. The server runs in-process
here, with the collector off, so what is retained is measured exactly rather than through a whole process's RSS."""

from __future__ import annotations

import gc
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from tritonclient.grpc import service_pb2

from halfserve.settings import Settings
from tests.conftest import free_port
from tests.integration.conftest import serving

pytestmark = pytest.mark.slow

INFER = "/inference.GRPCInferenceService/ModelInfer"
CALLS = 100
STREAMS = 30
PAYLOAD = 60_000
"""Bytes of data in each refused message: under the tiny model's message cap (64 KiB and a bit)."""


@pytest.fixture
def no_collector() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _unknown_model() -> bytes:
    request = service_pb2.ModelInferRequest(model_name="nope")  # refused once parsed: no such model
    request.inputs.add(name="features", datatype="FP32", shape=[1, 16])
    request.raw_input_contents.append(b"\1" * PAYLOAD)
    return request.SerializeToString()


def _too_many_values() -> bytes:
    request = service_pb2.ModelInferRequest(model_name="tiny")  # refused before it is parsed: 15,000 values for 1
    request.inputs.add(name="features", datatype="FP32", shape=[1]).contents.fp32_contents.extend([1.0] * 15_000)
    return request.SerializeToString()


@pytest.mark.parametrize("message", [_unknown_model, _too_many_values], ids=["unknown-model", "too-many-values"])
async def test_refused_calls_leave_no_request_in_memory(tiny_store: Path, no_collector: None, message: object) -> None:
    assert callable(message)
    raw: bytes = message()
    port = free_port()
    settings = Settings(store=tiny_store, precision="fp32", grpc=True, grpc_port=port, host="127.0.0.1")
    async with serving(settings), grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        infer = channel.unary_unary(INFER)

        async def refuse() -> None:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await infer(raw, timeout=20)
            assert info.value.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT)

        for _ in range(5):  # what the first calls set up once (channels, caches) is not counted
            await refuse()
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            for _ in range(CALLS):
                await refuse()
            retained = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
    # Kept, each refused message would be CALLS x len(raw) (6 MB); a generous fifth of that is allowed for whatever
    # else the server and the client keep meanwhile.
    assert retained < CALLS * len(raw) / 5, f"{retained} bytes retained over {CALLS} refused calls of {len(raw)}"


async def test_failed_streams_leave_no_request_in_memory(tiny_store: Path, no_collector: None) -> None:
    # A stream that goes idle fails (DEADLINE_EXCEEDED) after one refused message of PAYLOAD bytes.
    raw = _unknown_model()
    port = free_port()
    settings = Settings(
        store=tiny_store, precision="fp32", grpc=True, grpc_port=port, host="127.0.0.1", grpc_idle_timeout=0.2
    )
    async with serving(settings), grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stream = channel.stream_stream("/inference.GRPCInferenceService/ModelStreamInfer")

        async def fail() -> None:
            call = stream()
            await call.write(raw)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                async for _ in call:
                    pass
            assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED

        for _ in range(3):
            await fail()
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            for _ in range(STREAMS):
                await fail()
            retained = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
    # A stream's own objects (grpcio's call and the stream's tasks, some 14 KB) wait for a collection too: half of
    # what the messages would be is allowed.
    assert retained < STREAMS * len(raw) / 2, f"{retained} bytes retained over {STREAMS} failed streams of {len(raw)}"
