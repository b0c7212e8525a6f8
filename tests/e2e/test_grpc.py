"""The official Triton gRPC client (``tritonclient.grpc``) against a real ``halfserve serve``: KServe V2 over gRPC."""

from __future__ import annotations

import asyncio
import signal
import threading
from collections.abc import Callable, Iterator
from multiprocessing import shared_memory
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
import tritonclient.grpc as tg
from tritonclient.grpc import service_pb2
from tritonclient.utils import InferenceServerException

from halfserve import grpc_messages
from tests.conftest import ServerProcess, free_port, save_tiny_mlp, shm_key
from tests.waiting import wait_until

pytestmark = pytest.mark.slow

MODEL = "tiny"
TOKEN = "e2e-grpc-admin-token-0123456789"
AUTH = {"authorization": f"Bearer {TOKEN}"}
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

StartServer = Callable[..., ServerProcess]


class GrpcEndpoint:
    """A server process and the address of its gRPC port."""

    def __init__(self, process: ServerProcess, port: int) -> None:
        self.process, self.address = process, f"127.0.0.1:{port}"

    @property
    def url(self) -> str:
        return self.process.url


def serve_grpc(server_factory: StartServer, store: Path, *args: str) -> GrpcEndpoint:
    port = free_port()
    return GrpcEndpoint(server_factory(store, "--grpc", "--grpc-port", str(port), *args), port)


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("grpc-store")
    save_tiny_mlp(root)
    return root


@pytest.fixture(scope="module")
def server(server_factory: StartServer, store_dir: Path) -> GrpcEndpoint:
    return serve_grpc(server_factory, store_dir, "--precision", "fp32", "--max-delay-ms", "20", "--admin-token", TOKEN)


@pytest.fixture
def client(server: GrpcEndpoint) -> Iterator[tg.InferenceServerClient]:
    c = tg.InferenceServerClient(server.address)
    try:
        yield c
    finally:
        c.close()


def features(rows: int, seed: int = 0, dtype: Any = np.float32) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, 16)).astype(dtype)


def grpc_input(x: np.ndarray, name: str = "features", datatype: str = "FP32") -> tg.InferInput:
    inp = tg.InferInput(name, list(x.shape), datatype)
    inp.set_data_from_numpy(x)
    return inp


def http_logits(url: str, x: np.ndarray) -> np.ndarray:
    body = {"inputs": [{"name": "features", "shape": list(x.shape), "datatype": "FP32", "data": x.ravel().tolist()}]}
    r = httpx.post(f"{url}/v2/models/{MODEL}/infer", json=body, timeout=30)
    assert r.status_code == 200, r.text
    out = r.json()["outputs"][0]
    return np.array(out["data"], dtype=np.float32).reshape(out["shape"])


def refusal(call: Callable[[], object]) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as info:
        call()
    return info.value


# Health and metadata -----------------------------------------------------------------------------------------------


def test_health_and_server_metadata(client: tg.InferenceServerClient) -> None:
    assert client.is_server_live()
    assert client.is_server_ready()
    assert client.is_model_ready(MODEL)
    meta = client.get_server_metadata()
    assert meta.name == "halfserve"
    assert {"binary_tensor_data", "classification", "statistics", "model_repository"} <= set(meta.extensions)


def test_model_metadata_and_config_match_the_manifest(client: tg.InferenceServerClient) -> None:
    meta = client.get_model_metadata(MODEL, as_json=True)
    assert meta["versions"] == ["1"]
    assert meta["inputs"] == [{"name": "features", "datatype": "FP32", "shape": ["-1", "16"]}]
    assert meta["outputs"] == [{"name": "logits", "datatype": "FP32", "shape": ["-1", "4"]}]
    config = client.get_model_config(MODEL).config
    assert config.max_batch_size == 8
    assert [(i.name, list(i.dims)) for i in config.input] == [("features", [16])]
    assert config.input[0].data_type == service_pb2.model__config__pb2.TYPE_FP32
    assert config.dynamic_batching.max_queue_delay_microseconds == 20_000
    assert config.parameters["precision"].string_value == "fp32"
    assert config.parameters["adaptive_delay"].string_value == "true"


def test_unknown_models_and_versions_are_not_found(client: tg.InferenceServerClient) -> None:
    e = refusal(lambda: client.get_model_metadata("nope"))
    assert e.status() == "StatusCode.NOT_FOUND"
    assert e.message().startswith("Request for unknown model: 'nope' is not found")
    e = refusal(lambda: client.get_model_config(MODEL, model_version="7"))
    assert e.status() == "StatusCode.NOT_FOUND"
    assert e.message() == "Request for unknown model: 'tiny' version 7 is not found (it serves version 1)"
    e = refusal(lambda: client.infer("nope", [grpc_input(features(1))]))
    assert e.status() == "StatusCode.NOT_FOUND"


def test_the_standard_health_service_answers_probes(server: GrpcEndpoint) -> None:
    request, response = grpc_messages.message("grpc.health.v1.HealthCheckRequest"), grpc_messages.HealthCheckResponse
    serving = response.ServingStatus.Value("SERVING")
    with grpc.insecure_channel(server.address) as channel:
        check = channel.unary_unary(
            "/grpc.health.v1.Health/Check",
            request_serializer=request.SerializeToString,
            response_deserializer=response.FromString,
        )
        assert check(request(service=""), timeout=10).status == serving
        assert check(request(service="inference.GRPCInferenceService"), timeout=10).status == serving
        with pytest.raises(grpc.RpcError) as info:
            check(request(service="elsewhere"), timeout=10)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND


# Inference ---------------------------------------------------------------------------------------------------------


def test_raw_fp32_answers_as_http_does(server: GrpcEndpoint, client: tg.InferenceServerClient) -> None:
    x = features(5, seed=1)
    result = client.infer(MODEL, [grpc_input(x)], request_id="req-1")
    logits = result.as_numpy("logits")
    assert logits.shape == (5, 4)
    assert logits.dtype == np.float32
    np.testing.assert_allclose(logits, http_logits(server.url, x), rtol=1e-5, atol=1e-6)
    response = result.get_response()
    assert response.id == "req-1"
    assert response.model_version == "1"
    assert response.parameters["precision"].string_param == "fp32"


def test_hundreds_of_calls_at_once_on_one_channel_are_all_answered(server: GrpcEndpoint) -> None:
    """As a load generator sends them (perf_analyzer at c=256 shares one channel): with 32 streams a connection,
    40% to 60% of 200 such calls were refused RST_STREAM (UNAVAILABLE), though the client kept to the limit."""
    import tritonclient.grpc.aio as tga

    x = features(1, seed=3)

    async def all_at_once() -> list[Any]:
        client = tga.InferenceServerClient(server.address)
        try:
            calls = [client.infer(MODEL, [grpc_input(x)]) for _ in range(200)]
            return await asyncio.gather(*calls, return_exceptions=True)
        finally:
            await client.close()

    results = asyncio.run(all_at_once())
    failed = [str(r)[:120] for r in results if isinstance(r, BaseException)]
    assert failed == [], f"{len(failed)} of 200 failed: {set(failed)}"
    expected = http_logits(server.url, x)
    for r in results:
        np.testing.assert_allclose(r.as_numpy("logits"), expected, rtol=1e-5, atol=1e-6)


def test_fp16_travels_raw_and_is_served(server: GrpcEndpoint, client: tg.InferenceServerClient) -> None:
    x = features(3, seed=2)
    result = client.infer(MODEL, [grpc_input(x.astype(np.float16), datatype="FP16")])
    np.testing.assert_allclose(result.as_numpy("logits"), http_logits(server.url, x), rtol=1e-2, atol=1e-2)


def test_typed_contents_are_accepted_and_fp16_there_is_refused(client: tg.InferenceServerClient) -> None:
    x = features(2, seed=3)
    stub = client._client_stub
    request = service_pb2.ModelInferRequest(model_name=MODEL)
    tensor = request.inputs.add(name="features", datatype="FP32", shape=[2, 16])
    tensor.contents.fp32_contents.extend(x.ravel().tolist())
    response = stub.ModelInfer(request)
    raw = np.frombuffer(response.raw_output_contents[0], dtype=np.float32).reshape(2, 4)
    np.testing.assert_allclose(raw, client.infer(MODEL, [grpc_input(x)]).as_numpy("logits"), rtol=1e-5, atol=1e-6)

    tensor.datatype = "FP16"
    with pytest.raises(grpc.RpcError) as info:
        stub.ModelInfer(request)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "FP16 data travels in raw_input_contents only" in info.value.details()

    tensor.datatype = "FP32"
    del tensor.contents.fp32_contents[-1]
    with pytest.raises(grpc.RpcError) as info:
        stub.ModelInfer(request)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "inputs[0].contents.fp32_contents: 31 values, but shape [2, 16] holds 32" in info.value.details()


def test_classification_gives_the_top_classes_with_labels(client: tg.InferenceServerClient) -> None:
    x = features(4, seed=4)
    logits = client.infer(MODEL, [grpc_input(x)]).as_numpy("logits")
    top = client.infer(MODEL, [grpc_input(x)], outputs=[tg.InferRequestedOutput("logits", class_count=2)])
    classes = top.as_numpy("logits")
    assert classes.shape == (4, 2)
    labels = ["a", "b", "c", "d"]
    for row, entries in zip(logits, classes, strict=True):
        value, index, label = entries[0].decode().split(":")
        assert int(index) == int(row.argmax())
        assert label == labels[int(index)]
        assert float(value) == pytest.approx(float(row.max()), abs=1e-5)


def test_malformed_requests_are_refused_naming_the_field(client: tg.InferenceServerClient) -> None:
    e = refusal(lambda: client.infer(MODEL, [grpc_input(np.zeros((1, 3), np.float32))]))
    assert e.status() == "StatusCode.INVALID_ARGUMENT"
    assert "inputs[0].shape: unexpected shape for input 'features' for model 'tiny'. Expected [-1,16], got [1,3]" in (
        e.message()
    )
    e = refusal(lambda: client.infer(MODEL, [grpc_input(features(1), name="pixels")]))
    assert e.status() == "StatusCode.INVALID_ARGUMENT"
    assert "unexpected inference input 'pixels' for model 'tiny'; the model takes input 'features'" in e.message()
    e = refusal(lambda: client.infer(MODEL, [grpc_input(np.zeros((1, 16), bool), datatype="BOOL")]))
    assert e.status() == "StatusCode.INVALID_ARGUMENT"
    assert "inference input 'features' data-type is 'BOOL', but model 'tiny' expects 'FP32'" in e.message()
    nan = features(1)
    nan[0, 3] = np.nan
    e = refusal(lambda: client.infer(MODEL, [grpc_input(nan)]))
    assert e.status() == "StatusCode.INVALID_ARGUMENT"
    assert "NaN" in e.message()
    e = refusal(lambda: client.infer(MODEL, [grpc_input(features(9))]))
    assert e.status() == "StatusCode.RESOURCE_EXHAUSTED"
    assert "9 rows exceed the limit of 8" in e.message()
    # The raw data of an input that was not declared.
    request = service_pb2.ModelInferRequest(model_name=MODEL)
    request.inputs.add(name="features", datatype="FP32", shape=[1, 16])
    request.raw_input_contents.extend([features(1).tobytes(), b"extra"])
    with pytest.raises(grpc.RpcError) as info:
        client._client_stub.ModelInfer(request)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "raw_input_contents: 2 entries for 1 inputs" in info.value.details()
    assert client.infer(MODEL, [grpc_input(features(1))]).as_numpy("logits").shape == (1, 4)  # still serving


def test_a_queue_timeout_answers_deadline_exceeded(server_factory: StartServer, store_dir: Path) -> None:
    slow = serve_grpc(server_factory, store_dir, "--max-delay-ms", "2000", "--no-adaptive-delay", "--precision", "fp32")
    with tg.InferenceServerClient(slow.address) as c:
        e = refusal(lambda: c.infer(MODEL, [grpc_input(features(1))], timeout=100_000))  # 100 ms, in microseconds
        assert e.status() == "StatusCode.DEADLINE_EXCEEDED"


# Several inputs, batching with HTTP, streams -------------------------------------------------------------------------


def test_int32_inputs_of_the_simple_model(server_factory: StartServer) -> None:
    folder = EXAMPLES / "simple"
    simple = serve_grpc(server_factory, folder / "model_store", "--code-path", str(folder))
    a = np.arange(32, dtype=np.int32).reshape(2, 16)
    b = np.full((2, 16), 3, dtype=np.int32)
    with tg.InferenceServerClient(simple.address) as c:
        inputs = [grpc_input(a, "INPUT0", "INT32"), grpc_input(b, "INPUT1", "INT32")]
        result = c.infer("simple", inputs)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)
        only = c.infer("simple", inputs, outputs=[tg.InferRequestedOutput("OUTPUT1")])
        assert only.as_numpy("OUTPUT0") is None
        np.testing.assert_array_equal(only.as_numpy("OUTPUT1"), a - b)
        # Typed int_contents; a value beyond INT32 cannot be sent there, and one missing input is named.
        request = service_pb2.ModelInferRequest(model_name="simple")
        for name, arr in (("INPUT0", a), ("INPUT1", b)):
            request.inputs.add(name=name, datatype="INT32", shape=[2, 16]).contents.int_contents.extend(arr.ravel())
        response = c._client_stub.ModelInfer(request)
        sums = np.frombuffer(response.raw_output_contents[0], dtype=np.int32).reshape(2, 16)
        np.testing.assert_array_equal(sums, a + b)
        e = refusal(lambda: c.infer("simple", inputs[:1]))
        assert e.status() == "StatusCode.INVALID_ARGUMENT"
        assert (
            "expected 2 inputs but got 1 inputs for model 'simple'. Got input(s) ['INPUT0'], but missing "
            in e.message()
        )


def test_grpc_and_http_requests_share_a_batch(server_factory: StartServer, store_dir: Path) -> None:
    # A batch is cut when 8 rows are queued or after 5 s (the whole delay: not adaptive): 4 rows over HTTP and 4 over
    # gRPC make exactly one batch of 8 only if both protocols feed the same batcher.
    shared = serve_grpc(
        server_factory, store_dir, "--max-delay-ms", "5000", "--no-adaptive-delay", "--precision", "fp32"
    )
    x = features(4, seed=5)
    answers: dict[str, np.ndarray] = {}

    def over_http() -> None:
        answers["http"] = http_logits(shared.url, x)

    thread = threading.Thread(target=over_http)
    thread.start()
    with tg.InferenceServerClient(shared.address) as c:
        answers["grpc"] = c.infer(MODEL, [grpc_input(x)]).as_numpy("logits")
        thread.join(timeout=30)
        stats = c.get_inference_statistics(MODEL).model_stats[0]
    np.testing.assert_allclose(answers["grpc"], answers["http"], rtol=1e-5, atol=1e-6)
    assert stats.execution_count == 1
    assert stats.inference_count == 8
    assert [(b.batch_size, b.compute_infer.count) for b in stats.batch_stats] == [(8, 1)]
    # Cut once full, not after the 5 s delay: the first request waited for the second, which waited for nothing; had
    # the batch waited out the delay, the first alone would have waited 5 s. (However long the second took to come.)
    assert stats.inference_stats.queue.count == 2
    assert stats.inference_stats.queue.ns < 5e9


def test_stream_answers_every_request_and_an_error_does_not_end_it(client: tg.InferenceServerClient) -> None:
    results: dict[str, object] = {}
    done = threading.Event()
    expected = 9

    def callback(result: tg.InferResult | None, error: InferenceServerException | None) -> None:
        if error is not None:
            results[f"error-{len(results)}"] = error
        else:
            assert result is not None
            results[result.get_response().id] = result.as_numpy("logits")
        if len(results) == expected:
            done.set()

    x = features(8, seed=6)
    client.start_stream(callback)
    try:
        for i in range(8):
            client.async_stream_infer(MODEL, [grpc_input(x[i : i + 1])], request_id=f"r{i}")
        client.async_stream_infer(MODEL, [grpc_input(np.zeros((1, 5), np.float32))], request_id="bad")
        assert done.wait(30), results
    finally:
        client.stop_stream()
    alone = client.infer(MODEL, [grpc_input(x)]).as_numpy("logits")
    for i in range(8):
        np.testing.assert_allclose(results[f"r{i}"], alone[i : i + 1], rtol=1e-5, atol=1e-6)
    errors = [v for k, v in results.items() if k.startswith("error")]
    assert len(errors) == 1
    assert "inputs[0].shape" in str(errors[0])


# Statistics, repository, metrics -------------------------------------------------------------------------------------


def test_statistics_count_rows_and_batches(client: tg.InferenceServerClient) -> None:
    before = client.get_inference_statistics(MODEL).model_stats[0]
    for rows in (1, 3):
        client.infer(MODEL, [grpc_input(features(rows))])
    after = client.get_inference_statistics(MODEL).model_stats[0]
    assert after.inference_count - before.inference_count == 4
    assert after.inference_stats.success.count - before.inference_stats.success.count == 2
    assert 1 <= after.execution_count - before.execution_count <= 2
    every = client.get_inference_statistics()
    assert [s.name for s in every.model_stats] == [MODEL]


def test_repository_calls_need_the_admin_token(client: tg.InferenceServerClient) -> None:
    e = refusal(lambda: client.get_model_repository_index())
    assert e.status() == "StatusCode.UNAUTHENTICATED"
    e = refusal(lambda: client.unload_model(MODEL, headers={"authorization": "Bearer wrong-token-0123456789"}))
    assert e.status() == "StatusCode.UNAUTHENTICATED"
    assert "wrong admin token" in e.message()
    assert client.is_model_ready(MODEL)
    index = client.get_model_repository_index(headers=AUTH, as_json=True)["models"]
    assert index == [{"name": MODEL, "version": "1", "state": "READY"}]
    client.unload_model(MODEL, headers=AUTH)
    try:
        assert not client.is_model_ready(MODEL)
        e = refusal(lambda: client.infer(MODEL, [grpc_input(features(1))]))
        assert e.status() == "StatusCode.NOT_FOUND"
        assert e.message().startswith("Request for unknown model: 'tiny' has no available versions (unloaded)")
    finally:
        client.load_model(MODEL, headers=AUTH)
    assert client.is_model_ready(MODEL)
    assert client.infer(MODEL, [grpc_input(features(2))]).as_numpy("logits").shape == (2, 4)
    e = refusal(lambda: client.load_model("absent", headers=AUTH))
    assert e.status() == "StatusCode.NOT_FOUND"
    load = service_pb2.RepositoryModelLoadRequest(model_name=MODEL)
    load.parameters["version"].string_param = "1"  # not a load parameter: it was ignored unseen, as over HTTP
    with pytest.raises(grpc.RpcError) as info:
        client._client_stub.RepositoryModelLoad(load, metadata=list(AUTH.items()))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith("parameters: 'version': not a parameter a load takes;")


def test_a_server_without_a_token_refuses_management(server_factory: StartServer, store_dir: Path) -> None:
    plain = serve_grpc(server_factory, store_dir)
    with tg.InferenceServerClient(plain.address) as c:
        e = refusal(lambda: c.unload_model(MODEL, headers=AUTH))
        assert e.status() == "StatusCode.PERMISSION_DENIED"
        assert c.is_model_ready(MODEL)


def test_metrics_count_grpc_requests(server: GrpcEndpoint, client: tg.InferenceServerClient) -> None:
    def grpc_ok() -> float:
        text = httpx.get(f"{server.url}/metrics", timeout=10).text
        line = f'halfserve_requests_total{{model="{MODEL}",precision="fp32",protocol="grpc",status="200"}}'
        return sum(float(x.split()[-1]) for x in text.splitlines() if x.startswith(line))

    before = grpc_ok()
    for _ in range(3):
        client.infer(MODEL, [grpc_input(features(1))])
    assert grpc_ok() - before == 3


# Shutdown ------------------------------------------------------------------------------------------------------------


def test_sigterm_answers_the_call_in_flight_then_exits_cleanly(server_factory: StartServer, store_dir: Path) -> None:
    draining = serve_grpc(
        server_factory, store_dir, "--max-delay-ms", "1500", "--no-adaptive-delay", "--precision", "fp32"
    )
    answer: dict[str, object] = {}

    def call() -> None:
        with tg.InferenceServerClient(draining.address) as c:
            try:
                answer["logits"] = c.infer(MODEL, [grpc_input(features(2))]).as_numpy("logits")
            except InferenceServerException as e:
                answer["error"] = e

    def queued() -> int:
        return int(httpx.get(f"{draining.url}/models/{MODEL}/stats", timeout=10).json()["queued_rows"])

    thread = threading.Thread(target=call)
    thread.start()
    # Queued, waiting out its batch delay, before the signal: a call that comes after it is refused, as it should be.
    # (One answered first, on a host that took the whole delay to look, has nothing left to drain.)
    wait_until(lambda: answer or queued() == 2, "the call queued")
    draining.process.proc.send_signal(signal.SIGTERM)
    thread.join(timeout=30)
    assert answer.get("error") is None
    assert np.asarray(answer["logits"]).shape == (2, 4)
    assert draining.process.proc.wait(timeout=30) == 0


def test_grpc_with_http_front_ends_is_served_by_the_engine_process(
    server_factory: StartServer, store_dir: Path
) -> None:
    # With --http-workers the front-ends take HTTP; gRPC is answered in the engine process, by the same batcher.
    workers = serve_grpc(server_factory, store_dir, "--http-workers", "2", "--precision", "fp32")
    x = features(3, seed=7)
    with tg.InferenceServerClient(workers.address) as c:
        before = c.get_inference_statistics(MODEL).model_stats[0].inference_count
        logits = c.infer(MODEL, [grpc_input(x)]).as_numpy("logits")
        np.testing.assert_allclose(logits, http_logits(workers.url, x), rtol=1e-5, atol=1e-6)
        assert c.get_inference_statistics(MODEL).model_stats[0].inference_count - before == 6


def test_system_shared_memory_regions_over_grpc_need_the_token(
    client: tg.InferenceServerClient, segment: shared_memory.SharedMemory
) -> None:
    key = shm_key(segment)
    e = refusal(lambda: client.register_system_shared_memory("grpc-region", key, 1024))
    assert e.status() == "StatusCode.UNAUTHENTICATED"
    client.register_system_shared_memory("grpc-region", key, 1024, offset=64, headers=AUTH)
    try:
        status = client.get_system_shared_memory_status(headers=AUTH, as_json=True)["regions"]
        assert status["grpc-region"] == {"name": "grpc-region", "key": key, "offset": "64", "byte_size": "1024"}
        e = refusal(lambda: client.get_system_shared_memory_status("absent", headers=AUTH))
        assert e.status() == "StatusCode.NOT_FOUND"
    finally:
        client.unregister_system_shared_memory("grpc-region", headers=AUTH)
    assert client.get_system_shared_memory_status(headers=AUTH, as_json=True) == {}
