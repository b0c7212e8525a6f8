"""The gRPC port under abusive input: each refused quickly, with the server serving on for everyone else."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import httpx
import numpy as np
import pytest
import tritonclient.grpc as tg
from tritonclient.grpc import service_pb2
from tritonclient.utils import InferenceServerException

from halfserve.execution import Batching
from tests.conftest import ServerProcess, free_port, save_tiny_mlp

pytestmark = pytest.mark.slow

MODEL = "tiny"
StartServer = Callable[..., ServerProcess]


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("grpc-limits-store")
    save_tiny_mlp(root)
    return root


def serve(server_factory: StartServer, store: Path, *args: str) -> str:
    port = free_port()
    server_factory(store, "--grpc", "--grpc-port", str(port), "--precision", "fp32", *args)
    return f"127.0.0.1:{port}"


@pytest.fixture(scope="module")
def address(server_factory: StartServer, store_dir: Path) -> str:
    return serve(server_factory, store_dir, "--max-body-bytes", "65536", "--header-timeout", "1")


def stub(address: str) -> Callable[..., object]:
    channel = grpc.insecure_channel(address, options=[("grpc.max_send_message_length", 64 * 2**20)])
    return channel.unary_unary(  # type: ignore[no-any-return]
        "/inference.GRPCInferenceService/ModelInfer",
        request_serializer=service_pb2.ModelInferRequest.SerializeToString,
        response_deserializer=service_pb2.ModelInferResponse.FromString,
    )


def one_row(address: str) -> np.ndarray:
    """A plain request, answered: the server still serves."""
    x = np.ones((1, 16), np.float32)
    inp = tg.InferInput("features", [1, 16], "FP32")
    inp.set_data_from_numpy(x)
    with tg.InferenceServerClient(address) as c:
        out: np.ndarray = c.infer(MODEL, [inp], client_timeout=10).as_numpy("logits")
    assert out.shape == (1, 4)
    return out


def refused(call: Callable[[], object]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value


def test_a_message_over_max_body_bytes_is_refused_unread(address: str) -> None:
    request = service_pb2.ModelInferRequest(model_name=MODEL)
    request.inputs.add(name="features", datatype="FP32", shape=[1, 16])
    request.raw_input_contents.append(b"\0" * 200_000)
    e = refused(lambda: stub(address)(request, timeout=10))
    assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    one_row(address)


def test_a_huge_declared_shape_is_refused_before_any_data_is_read(address: str) -> None:
    request = service_pb2.ModelInferRequest(model_name=MODEL)
    request.inputs.add(name="features", datatype="FP32", shape=[2**40, 16])
    request.raw_input_contents.append(b"\0" * 64)
    e = refused(lambda: stub(address)(request, timeout=10))
    assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "inputs[0].shape: 1099511627776 rows exceed the limit of 8" in str(e.details())
    one_row(address)


def test_thousands_of_input_entries_are_refused_at_once(address: str) -> None:
    request = service_pb2.ModelInferRequest(model_name=MODEL)
    for _ in range(2500):  # about 55 KB, under the 64 KiB message limit this server has
        request.inputs.add(name="features", datatype="FP32", shape=[1, 16])
    start = time.monotonic()
    e = refused(lambda: stub(address)(request, timeout=10))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "inputs: expected 1 inputs but got 2500 inputs for model 'tiny'" in str(e.details())
    assert time.monotonic() - start < 5
    one_row(address)


def test_oversized_metadata_is_refused(address: str) -> None:
    request = service_pb2.ModelInferRequest(model_name=MODEL)
    e = refused(lambda: stub(address)(request, timeout=10, metadata=[("x-padding", "p" * 200_000)]))
    assert e.code() in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE)
    one_row(address)


def test_bytes_that_are_not_http2_get_the_connection_closed(address: str) -> None:
    host, port = address.split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + bytes(range(256)) * 64)
        sock.settimeout(10)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    # The server answered with at most an HTTP/2 GOAWAY and then closed: recv returned b"" before the timeout.
    assert len(received) < 4096
    one_row(address)


def test_a_silent_connection_is_closed_after_the_header_timeout(address: str) -> None:
    host, port = address.split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        start = time.monotonic()
        sock.settimeout(10)
        while sock.recv(65536):  # the server's SETTINGS frame, then nothing until it closes
            pass
        assert time.monotonic() - start < 6  # --header-timeout 1, with room for a slow machine
    one_row(address)


def test_calls_past_max_connections_are_refused_not_queued(server_factory: StartServer, store_dir: Path) -> None:
    # Three calls at a time; a batch is cut only after 3 s (8 rows never arrive), so the first three hold their
    # slots and the rest are refused at once.
    address = serve(
        server_factory, store_dir, "--max-connections", "3", "--max-delay-ms", "3000", "--no-adaptive-delay"
    )
    outcomes: list[str] = []
    lock = threading.Lock()

    def call() -> None:
        inp = tg.InferInput("features", [1, 16], "FP32")
        inp.set_data_from_numpy(np.ones((1, 16), np.float32))
        with tg.InferenceServerClient(address) as c:
            try:
                c.infer(MODEL, [inp], client_timeout=20)
                outcome = "ok"
            except InferenceServerException as e:
                outcome = str(e.status())
        with lock:
            outcomes.append(outcome)

    threads = [threading.Thread(target=call) for _ in range(7)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert len(outcomes) == 7
    assert outcomes.count("ok") >= 3
    assert outcomes.count("StatusCode.RESOURCE_EXHAUSTED") >= 1
    assert set(outcomes) <= {"ok", "StatusCode.RESOURCE_EXHAUSTED"}
    one_row(address)


def test_a_stream_of_a_thousand_bad_requests_is_answered_and_serving_goes_on(address: str) -> None:
    # At most 256 of a stream's requests are in flight; each bad one is answered with its error, in order of answer.
    bad = service_pb2.ModelInferRequest(model_name=MODEL)
    bad.inputs.add(name="features", datatype="FP32", shape=[1, 5])
    bad.raw_input_contents.append(np.zeros(5, np.float32).tobytes())
    with grpc.insecure_channel(address) as channel:
        stream = channel.stream_stream(
            "/inference.GRPCInferenceService/ModelStreamInfer",
            request_serializer=service_pb2.ModelInferRequest.SerializeToString,
            response_deserializer=service_pb2.ModelStreamInferResponse.FromString,
        )
        start = time.monotonic()
        answers = list(stream(iter([bad] * 1000), timeout=60))
    assert len(answers) == 1000
    assert all("inputs[0].shape: unexpected shape for input 'features'" in a.error_message for a in answers)
    assert time.monotonic() - start < 30
    one_row(address)


def test_typed_contents_with_a_shape_whose_count_overflows_64_bits_are_refused(address: str) -> None:
    # 2^62 x 16 values wrap to 0 in 64-bit arithmetic: counted exactly, no empty contents can match it. One row, so
    # the rows check (made first) lets it through to the count.
    request = service_pb2.ModelInferRequest(model_name=MODEL)
    request.inputs.add(name="features", datatype="FP32", shape=[1, 2**62, 16])
    e = refused(lambda: stub(address)(request, timeout=10))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"0 values, but shape [1, {2**62}, 16] holds {2**66}" in str(e.details())
    one_row(address)


def test_a_model_loaded_after_start_takes_over_grpc_the_requests_it_takes_over_http(
    server_factory: StartServer, tmp_path: Path
) -> None:
    # grpcio's message limit is set once, at start: it was sized to the models served then, so a model with larger
    # requests loaded later (one --models left out) had them refused over gRPC and answered over HTTP.
    save_tiny_mlp(tmp_path)
    save_tiny_mlp(tmp_path, "wide", batching=Batching(max_batch_size=4096, max_delay_ms=5))
    token = "grpc-limits-admin-token-0123456789"
    port = free_port()
    server = server_factory(
        tmp_path, "--grpc", "--grpc-port", str(port), "--precision", "fp32", "--models", "tiny", "--admin-token", token
    )
    loaded = httpx.post(f"{server.url}/models/wide/load", json={}, headers={"authorization": f"Bearer {token}"})
    assert loaded.status_code == 200, loaded.text
    x = np.ones((2000, 16), np.float32)  # 128 KB: past what tiny's 8 rows need
    inp = tg.InferInput("features", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    with tg.InferenceServerClient(f"127.0.0.1:{port}") as c:
        out = c.infer("wide", [inp], client_timeout=30).as_numpy("logits")
    assert out.shape == (2000, 4)
