"""The gRPC port against clients that hold what it buffers: unfinished and silent calls, idle and surplus
connections, messages that parse into far more than their bytes, compressed and malformed messages. Each is refused
or cut off while the health check, another client's inference and HTTP ``/health`` go on answering."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import httpx
import numpy as np
import pytest
from tritonclient.grpc import service_pb2

from halfserve import grpc_messages
from tests.conftest import ServerProcess, free_port
from tests.security.raw_h2 import Connection, grpc_message
from tests.waiting import wait_until

pytestmark = pytest.mark.slow

MODEL = "tiny"
INFER = "/inference.GRPCInferenceService/ModelInfer"
CHECK = "/grpc.health.v1.Health/Check"
StartServer = Callable[..., ServerProcess]


class Endpoint:
    def __init__(self, process: ServerProcess, port: int) -> None:
        self.process, self.address = process, f"127.0.0.1:{port}"


def serve(server_factory: StartServer, store: Path, *args: str) -> Endpoint:
    port = free_port()
    process = server_factory(store, "--grpc", "--grpc-port", str(port), "--precision", "fp32", *args)
    return Endpoint(process, port)


@pytest.fixture(scope="module")
def patient(server_factory: StartServer, served_tiny_store: Path) -> Endpoint:
    """Long deadlines (the default 30 s body timeout), a small budget: what is held stays held during a test."""
    return serve(
        server_factory,
        served_tiny_store,
        "--grpc-max-streams",
        "8",
        "--max-connections",
        "16",
        "--grpc-pending-bytes",
        str(2**20),
        # one client (127.0.0.1) may hold every slot, and a silent call keeps its slot while others need it
        "--grpc-peer-share",
        "1",
        "--grpc-receive-grace",
        "60",
    )


@pytest.fixture(scope="module")
def strict(server_factory: StartServer, served_tiny_store: Path) -> Endpoint:
    """Short deadlines and few connections, for what is cut off."""
    return serve(
        server_factory, served_tiny_store, "--body-timeout", "1", "--grpc-idle-timeout", "2", "--max-connections", "6"
    )


@pytest.fixture
def connections(request: pytest.FixtureRequest) -> Iterator[list[Connection]]:
    opened: list[Connection] = []
    yield opened
    for c in opened:
        c.close()


def connect(address: str, opened: list[Connection]) -> Connection:
    c = Connection.to(address)
    opened.append(c)
    c.read(0.2)  # the server's SETTINGS
    return c


def infer_request(rows: int = 1) -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(model_name=MODEL)
    request.inputs.add(name="features", datatype="FP32", shape=[rows, 16])
    request.raw_input_contents.append(np.ones((rows, 16), np.float32).tobytes())
    return request


def call(address: str, request: object, **kwargs: object) -> service_pb2.ModelInferResponse:
    with grpc.insecure_channel(address) as channel:
        stub = channel.unary_unary(
            INFER,
            request_serializer=lambda m: m if isinstance(m, bytes) else m.SerializeToString(),
            response_deserializer=service_pb2.ModelInferResponse.FromString,
        )
        return stub(request, timeout=20, **kwargs)  # type: ignore[no-any-return]


def refusal(address: str, request: object, **kwargs: object) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call(address, request, **kwargs)
    return info.value


def healthy(endpoint: Endpoint) -> None:
    """The health check and readiness answer SERVING, another client's inference is answered, and HTTP /health."""
    with grpc.insecure_channel(endpoint.address) as channel:
        check = channel.unary_unary(
            CHECK,
            request_serializer=grpc_messages.message("grpc.health.v1.HealthCheckRequest").SerializeToString,
            response_deserializer=grpc_messages.HealthCheckResponse.FromString,
        )
        request = grpc_messages.message("grpc.health.v1.HealthCheckRequest")
        serving = grpc_messages.HealthCheckResponse.ServingStatus.Value("SERVING")
        assert check(request(service=""), timeout=10).status == serving
        assert check(request(service=grpc_messages.SERVICE), timeout=10).status == serving
    out = call(endpoint.address, infer_request())
    assert list(out.outputs[0].shape) == [1, 4]
    assert httpx.get(f"{endpoint.process.url}/health", timeout=10).status_code == 200


# 1. Unfinished messages --------------------------------------------------------------------------------------------


def test_a_message_declared_past_what_the_model_takes_is_refused_unread(
    patient: Endpoint, connections: list[Connection]
) -> None:
    # 60 MiB declared, 1 MiB sent: the tiny model's largest request is 8 rows of 16 floats, so the message cap is
    # 64 KiB and a bit, not max_body_bytes.
    c = connect(patient.address, connections)
    stream = c.open(INFER)
    c.send(stream, grpc_message(b"\0" * 2**20, declared=60 * 2**20)[: 2**20])
    assert c.wait(lambda: stream in c.ended, 20), "the stream is still open, its message still buffered"
    healthy(patient)


def test_silent_and_unfinished_messages_are_cut_off_at_the_body_timeout(
    strict: Endpoint, connections: list[Connection]
) -> None:
    c = connect(strict.address, connections)
    silent = c.open(INFER)
    unfinished = c.open(INFER)
    c.send(unfinished, grpc_message(b"\0" * 1000, declared=4000))
    assert c.wait(lambda: {silent, unfinished} <= c.ended.keys(), 20), f"still open: {c.ended}"
    healthy(strict)


def test_calls_receiving_their_messages_share_a_budget(patient: Endpoint, connections: list[Connection]) -> None:
    # 1 MiB of budget at 64 KiB and a bit a message: 15 calls. Three connections of 8 silent calls hold them all.
    for _ in range(3):
        c = connect(patient.address, connections)
        for _ in range(8):
            c.open(INFER)
        c.read(0.2)
    e = refusal(patient.address, infer_request())
    assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "grpc_pending_bytes" in str(e.details())
    # The health checks have a pool of their own.
    with grpc.insecure_channel(patient.address) as channel:
        check = channel.unary_unary(
            CHECK,
            request_serializer=grpc_messages.message("grpc.health.v1.HealthCheckRequest").SerializeToString,
            response_deserializer=grpc_messages.HealthCheckResponse.FromString,
        )
        assert check(grpc_messages.message("grpc.health.v1.HealthCheckRequest")(), timeout=10).status == 1
    assert httpx.get(f"{patient.process.url}/health", timeout=10).status_code == 200
    for c in connections:
        c.close()
    wait_until(lambda: _answers(patient.address), "inference answered once the silent calls are gone")


def _answers(address: str) -> bool:
    try:
        call(address, infer_request())
    except grpc.RpcError:
        return False
    return True


# 2. Amplification --------------------------------------------------------------------------------------------------


def test_empty_bytes_entries_are_counted_against_the_shape_before_they_are_built(patient: Endpoint) -> None:
    request = service_pb2.ModelInferRequest(model_name=MODEL)
    tensor = request.inputs.add(name="features", datatype="BYTES", shape=[1])
    tensor.contents.bytes_contents.extend([b""] * 30_000)  # 60 KB: under the message cap
    e = refusal(patient.address, request)
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "inputs[0].contents.bytes_contents: more than 1 values, but shape [1] holds 1" in str(e.details())
    healthy(patient)


def test_thousands_of_empty_inputs_are_refused_before_they_are_parsed(patient: Endpoint) -> None:
    request = service_pb2.ModelInferRequest(model_name=MODEL)
    for _ in range(5000):
        request.inputs.add()
    e = refusal(patient.address, request)
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "inputs: more than 4096 entries" in str(e.details())
    healthy(patient)


def test_compressed_messages_are_refused(patient: Endpoint) -> None:
    e = refusal(patient.address, infer_request(), compression=grpc.Compression.Gzip)
    assert e.code() == grpc.StatusCode.UNIMPLEMENTED
    healthy(patient)


# 3. Streams per connection -----------------------------------------------------------------------------------------


def test_one_connection_cannot_take_every_call_slot(patient: Endpoint, connections: list[Connection]) -> None:
    # The server allows 16 inference calls at once (max_connections) and 8 streams per connection: a hundred silent
    # streams on one connection leave the rest to everyone else.
    c = connect(patient.address, connections)
    assert c.max_streams == 8
    for _ in range(100):
        c.open(INFER)
    c.read(0.5)
    healthy(patient)
    for _ in range(3):
        call(patient.address, infer_request(2))


# 8. Idle and surplus connections -----------------------------------------------------------------------------------


def test_an_idle_connection_is_closed(strict: Endpoint, connections: list[Connection]) -> None:
    c = connect(strict.address, connections)
    assert c.wait(lambda: c.goaway or c.closed, 20), "an idle connection is still open"
    healthy(strict)


def test_connections_past_max_connections_are_closed(strict: Endpoint, connections: list[Connection]) -> None:
    held = [connect(strict.address, connections) for _ in range(12)]
    assert any(c.closed or c.goaway for c in held[6:])
    for c in held:
        c.close()
    wait_until(lambda: _answers(strict.address), "inference answered once the connections are gone")
    healthy(strict)


# 12. Malformed messages --------------------------------------------------------------------------------------------


def test_a_malformed_message_is_a_client_error_not_a_logged_traceback(strict: Endpoint) -> None:
    before = strict.process.log.read_text()
    e = refusal(strict.address, b"\x0a\xff\xff\xff\xff\x0f")  # a string field whose length runs past the end
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "request: not a valid ModelInferRequest message" in str(e.details())
    healthy(strict)
    logged = strict.process.log.read_text()[len(before) :]
    assert "Traceback" not in logged
    assert "ERROR" not in logged
