"""The official Triton HTTP client against a real ``halfserve serve`` subprocess: the V2 protocol as clients see it."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.http as triton
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException

from tests.conftest import ServerProcess, save_tiny_mlp

pytestmark = pytest.mark.slow

MODEL = "tiny"
TOKEN = "e2e-tritonclient-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}

StartServer = Callable[..., ServerProcess]


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("v2-store")
    save_tiny_mlp(root)
    return root


@pytest.fixture(scope="module")
def fp32_server(server_factory: StartServer, store_dir: Path) -> ServerProcess:
    return server_factory(store_dir, "--precision", "fp32", "--max-delay-ms", "20", "--admin-token", TOKEN)


@pytest.fixture(scope="module")
def fp16_server(server_factory: StartServer, store_dir: Path) -> ServerProcess:
    return server_factory(store_dir, "--precision", "fp16")


def connect(server: ServerProcess) -> Iterator[triton.InferenceServerClient]:
    client = triton.InferenceServerClient(url=server.url.removeprefix("http://"), concurrency=4)
    try:
        yield client
    finally:
        client.close()


@pytest.fixture
def client(fp32_server: ServerProcess) -> Iterator[triton.InferenceServerClient]:
    yield from connect(fp32_server)


@pytest.fixture
def fp16_client(fp16_server: ServerProcess) -> Iterator[triton.InferenceServerClient]:
    yield from connect(fp16_server)


def samples(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 16)).astype(np.float32)


def predict(server: ServerProcess, x: np.ndarray) -> np.ndarray:
    r = httpx.post(f"{server.url}/predict", json={"model": MODEL, "inputs": x.tolist()}, timeout=30)
    assert r.status_code == 200, r.text
    return np.asarray(r.json()["outputs"], dtype=np.float32)


def infer_input(x: np.ndarray, datatype: str, binary: bool) -> triton.InferInput:
    tensor = triton.InferInput("features", list(x.shape), datatype)
    tensor.set_data_from_numpy(x, binary_data=binary)
    return tensor


def test_server_and_model_metadata(client: triton.InferenceServerClient) -> None:
    assert client.is_server_live()
    assert client.is_server_ready()
    meta = client.get_server_metadata()
    assert meta["name"] == "halfserve"
    assert {"binary_tensor_data", "classification", "model_configuration", "statistics", "model_repository"} <= set(
        meta["extensions"]
    )
    model = client.get_model_metadata(MODEL)
    assert model["versions"] == ["1"]
    assert model["inputs"] == [{"name": "features", "datatype": "FP32", "shape": [-1, 16]}]
    assert model["outputs"] == [{"name": "logits", "datatype": "FP32", "shape": [-1, 4]}]
    assert client.get_model_metadata(MODEL, model_version="1") == model
    config = client.get_model_config(MODEL)
    assert config["max_batch_size"] == 8
    assert config["input"][0]["dims"] == [16]
    assert config["dynamic_batching"]["max_queue_delay_microseconds"] == 20_000
    assert client.is_model_ready(MODEL)
    assert client.is_model_ready(MODEL, model_version="1")
    assert not client.is_model_ready(MODEL, model_version="2")
    assert not client.is_model_ready("nope")
    with pytest.raises(InferenceServerException) as err:
        client.get_model_metadata("nope")
    # Triton's example clients check that the message starts so (simple_http_infer_client.py).
    assert err.value.message().startswith("Request for unknown model: 'nope' is not found")


@pytest.mark.parametrize("binary_in", [False, True], ids=["json-in", "binary-in"])
@pytest.mark.parametrize("binary_out", [False, True, None], ids=["json-out", "binary-out", "default-out"])
def test_fp32_inference_equals_predict(
    client: triton.InferenceServerClient, fp32_server: ServerProcess, binary_in: bool, binary_out: bool | None
) -> None:
    x = samples(3, seed=1)
    # No requested outputs (None) makes the client ask for every output as binary.
    outputs = None if binary_out is None else [triton.InferRequestedOutput("logits", binary_data=binary_out)]
    result = client.infer(MODEL, [infer_input(x, "FP32", binary_in)], outputs=outputs, request_id="r-1")
    response = result.get_response()
    assert response["id"] == "r-1"
    assert response["model_version"] == "1"
    assert response["parameters"] == {"precision": "fp32"}
    assert ("data" in response["outputs"][0]) is (binary_out is False)
    got = result.as_numpy("logits")
    assert got.dtype == np.float32
    assert got.shape == (3, 4)
    np.testing.assert_allclose(got, predict(fp32_server, x), rtol=1e-6, atol=1e-6)


def test_system_shared_memory(client: triton.InferenceServerClient, fp32_server: ServerProcess) -> None:
    """Inputs and outputs in a region made by tritonclient's own shared memory module, as perf_analyzer's
    ``--shared-memory system`` and Triton's shm examples use it."""
    x = samples(5, seed=9)
    key = f"/halfserve-e2e-{os.getpid()}"
    handle = shm.create_shared_memory_region("io", key, 1024)
    try:
        shm.set_shared_memory_region(handle, [x])
        client.register_system_shared_memory("io", key, 1024, headers=AUTH)
        status = client.get_system_shared_memory_status(headers=AUTH)
        assert status == [{"name": "io", "key": key, "offset": 0, "byte_size": 1024}]
        tensor = triton.InferInput("features", list(x.shape), "FP32")
        tensor.set_shared_memory("io", x.nbytes)
        out = triton.InferRequestedOutput("logits", binary_data=True)
        out.set_shared_memory("io", 5 * 4 * 4, offset=512)
        result = client.infer(MODEL, [tensor], outputs=[out], headers=AUTH)  # a region is used with the token
        output = result.get_output("logits")  # nothing in the body: the output is in the region
        assert "data" not in output
        assert output["parameters"] == {"shared_memory_region": "io", "shared_memory_byte_size": 80}
        got = shm.get_contents_as_numpy(handle, np.float32, [5, 4], offset=512)
        np.testing.assert_allclose(got, predict(fp32_server, x), rtol=1e-6, atol=1e-6)
        client.unregister_system_shared_memory(headers=AUTH)
        assert client.get_system_shared_memory_status(headers=AUTH) == []
        assert client.get_cuda_shared_memory_status() == []
    finally:
        shm.destroy_shared_memory_region(handle)


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
def test_compressed_requests(client: triton.InferenceServerClient, fp32_server: ServerProcess, algorithm: str) -> None:
    """``request_compression_algorithm``: the body arrives compressed and is inflated before decoding. The response
    comes back uncompressed whatever ``response_compression_algorithm`` asks for, which HTTP allows and the client
    reads as it is."""
    x = samples(3, seed=8)
    result = client.infer(
        MODEL,
        [infer_input(x, "FP32", binary=True)],
        request_compression_algorithm=algorithm,
        response_compression_algorithm=algorithm,
    )
    np.testing.assert_allclose(result.as_numpy("logits"), predict(fp32_server, x), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("binary_out", [False, True], ids=["json-out", "binary-out"])
def test_class_count_returns_the_top_labels(
    client: triton.InferenceServerClient, fp32_server: ServerProcess, binary_out: bool
) -> None:
    """``InferRequestedOutput(class_count=k)`` (the classification extension, as Triton's image_client uses it)."""
    x = samples(5, seed=7)
    want = predict(fp32_server, x)
    outputs = [triton.InferRequestedOutput("logits", binary_data=binary_out, class_count=3)]
    got = client.infer(MODEL, [infer_input(x, "FP32", True)], outputs=outputs).as_numpy("logits")
    assert got.shape == (5, 3)
    labels = "abcd"
    for row, values in zip(got, want, strict=True):
        best = np.argsort(-values, kind="stable")[:3]
        # BYTES elements come back as bytes from binary data and as str from JSON (the client's doing).
        assert [item.decode() if isinstance(item, bytes) else item for item in row] == [
            f"{values[i]:f}:{i}:{labels[i]}" for i in best
        ]


def test_fp16_inputs(fp16_client: triton.InferenceServerClient, fp16_server: ServerProcess) -> None:
    x = samples(4, seed=2).astype(np.float16)
    result = fp16_client.infer(MODEL, [infer_input(x, "FP16", binary=True)])
    assert result.get_response()["parameters"] == {"precision": "fp16"}
    # /predict's float32 copy of the same fp16 values is cast to fp16 by the engine: the very same forward.
    want = predict(fp16_server, x.astype(np.float32))
    np.testing.assert_array_equal(result.as_numpy("logits"), want)
    as_json = [triton.InferRequestedOutput("logits", binary_data=False)]
    result = fp16_client.infer(MODEL, [infer_input(x, "FP16", binary=True)], outputs=as_json)
    assert "data" in result.get_response()["outputs"][0]
    np.testing.assert_array_equal(result.as_numpy("logits"), want)
    # FP16 JSON is rejected: JSON has no 16-bit floats.
    with pytest.raises(InferenceServerException, match="FP16 data cannot travel as JSON") as err:
        fp16_client.infer(MODEL, [infer_input(x, "FP16", binary=False)])
    assert err.value.status() == "400"


def test_fp16_input_to_an_fp32_model(client: triton.InferenceServerClient, fp32_server: ServerProcess) -> None:
    x = samples(2, seed=3).astype(np.float16)
    result = client.infer(MODEL, [infer_input(x, "FP16", binary=True)])
    np.testing.assert_allclose(result.as_numpy("logits"), predict(fp32_server, x.astype(np.float32)), rtol=1e-6)


def test_inference_statistics_add_up(client: triton.InferenceServerClient) -> None:
    def snapshot() -> dict[str, Any]:
        stats = client.get_inference_statistics(MODEL)["model_stats"]
        assert [(s["name"], s["version"]) for s in stats] == [(MODEL, "1")]
        assert client.get_inference_statistics()["model_stats"] == stats  # the only model served
        assert client.get_inference_statistics(MODEL, model_version="1")["model_stats"] == stats
        return stats[0]

    before = snapshot()
    rows = [1, 2, 3, 4]
    pending = [client.async_infer(MODEL, [infer_input(samples(n, seed=n), "FP32", True)]) for n in rows]
    assert sorted(p.get_result().as_numpy("logits").shape[0] for p in pending) == rows
    after = snapshot()

    assert after["inference_count"] - before["inference_count"] == sum(rows)
    assert 1 <= after["execution_count"] - before["execution_count"] <= len(rows)
    before_n, after_n = before["inference_stats"], after["inference_stats"]
    counts = {k: after_n[k]["count"] - before_n[k]["count"] for k in ("success", "fail")}
    assert counts == {"success": len(rows), "fail": 0}
    assert after["inference_stats"]["compute_infer"]["count"] == after["execution_count"]
    batches = after["batch_stats"]
    assert sum(b["compute_infer"]["count"] for b in batches) == after["execution_count"]
    assert sum(b["batch_size"] * b["compute_infer"]["count"] for b in batches) == after["inference_count"]
    assert after["last_inference"] >= max(before["last_inference"], 1)


def test_repository_index_unload_and_load(client: triton.InferenceServerClient, fp32_server: ServerProcess) -> None:
    with pytest.raises(InferenceServerException, match="Bearer") as err:
        client.get_model_repository_index()
    assert err.value.status() == "401"
    assert client.get_model_repository_index(headers=AUTH) == [
        {"name": MODEL, "version": "1", "state": "READY", "reason": ""}
    ]
    x = samples(2, seed=4)
    want = client.infer(MODEL, [infer_input(x, "FP32", True)]).as_numpy("logits")

    client.unload_model(MODEL, headers=AUTH)
    assert not client.is_model_ready(MODEL)
    assert client.get_model_repository_index(headers=AUTH)[0]["state"] == "UNAVAILABLE"
    with pytest.raises(InferenceServerException, match="no available versions") as err:
        client.infer(MODEL, [infer_input(x, "FP32", True)])
    assert err.value.status() == "404"

    client.load_model(MODEL, headers=AUTH)
    assert client.is_model_ready(MODEL)
    assert client.get_model_repository_index(headers=AUTH)[0]["state"] == "READY"
    np.testing.assert_array_equal(client.infer(MODEL, [infer_input(x, "FP32", True)]).as_numpy("logits"), want)
