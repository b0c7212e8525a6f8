"""A real ``halfserve serve`` subprocess on 127.0.0.1 over the shipped, trained model store."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from halfserve import store
from tests.conftest import SHIPPED_STORE, ServerProcess

MODEL = "digits_mlp"
pytestmark = pytest.mark.slow

StartServer = Callable[..., ServerProcess]


def samples(n: int, seed: int = 0) -> np.ndarray:
    """Digit-like inputs in the model's value range [0, 1]."""
    return np.random.default_rng(seed).uniform(0, 1, size=(n, 256)).astype(np.float32)


def fp32_reference(x: np.ndarray) -> np.ndarray:
    loaded = store.load(SHIPPED_STORE, MODEL)
    with torch.inference_mode():
        return loaded.module(torch.from_numpy(x)).numpy()


async def predict_concurrently(url: str, x: np.ndarray) -> tuple[list[dict[str, object]], dict[str, object]]:
    limits = httpx.Limits(max_connections=len(x), max_keepalive_connections=len(x))
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=60) as client:
        responses = await asyncio.gather(
            *(client.post("/predict", json={"model": MODEL, "inputs": [row.tolist()]}) for row in x)
        )
        stats = (await client.get(f"/models/{MODEL}/stats")).json()
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses if r.status_code != 200][:3]
    return [r.json() for r in responses], stats


@pytest.fixture(scope="module")
def default_server(server_factory: StartServer) -> ServerProcess:
    # bf16 named explicitly: ``auto`` picks fp32 on a CPU without native bf16, and these tests are about half precision.
    return server_factory(
        SHIPPED_STORE, "--models", MODEL, "--precision", "bf16", "--max-delay-ms", "20", "--max-request-rows", "256"
    )


@pytest.fixture(scope="module")
def fp32_server(server_factory: StartServer) -> ServerProcess:
    # The fallback switch through its environment variable.
    return server_factory(
        SHIPPED_STORE, "--models", MODEL, env={"HALFSERVE_PRECISION": "fp32", "HALFSERVE_MAX_REQUEST_ROWS": "256"}
    )


def test_64_concurrent_requests_are_answered_correctly_in_batches(default_server: ServerProcess) -> None:
    x = samples(64)
    bodies, stats = asyncio.run(predict_concurrently(default_server.url, x))
    got = np.array([b["outputs"][0] for b in bodies])  # type: ignore[index]
    want = fp32_reference(x)
    # Served in half precision (bf16 on this CPU): within 3% of the logits' scale, same top class nearly always.
    np.testing.assert_allclose(got, want, atol=0.03 * np.abs(want).max(), rtol=0)
    assert (got.argmax(1) == want.argmax(1)).mean() >= 0.95
    assert [b["labels"][0] for b in bodies] == [str(i) for i in got.argmax(1)]  # type: ignore[index]
    assert stats["requests"] == 64
    assert stats["rows"] == 64
    hist = {int(k): v for k, v in stats["batch_size_histogram"].items()}  # type: ignore[union-attr]
    assert max(hist) > 1, hist
    assert stats["batches"] < 64


def test_fp32_switch_really_serves_fp32(fp32_server: ServerProcess) -> None:
    listing = httpx.get(f"{fp32_server.url}/models").json()["models"][0]
    assert listing["precision"] == "fp32"
    assert listing["weight_dtype"] == "float32"
    x = samples(8, seed=1)
    body = httpx.post(f"{fp32_server.url}/predict", json={"inputs": x.tolist()}).json()
    assert body["precision"] == "fp32"
    np.testing.assert_allclose(np.array(body["outputs"]), fp32_reference(x), rtol=1e-4, atol=1e-4)


def test_half_precision_agrees_with_the_fp32_switch(default_server: ServerProcess, fp32_server: ServerProcess) -> None:
    x = samples(256, seed=2)
    half = httpx.post(f"{default_server.url}/predict", json={"inputs": x.tolist()}, timeout=60).json()
    full = httpx.post(f"{fp32_server.url}/predict", json={"inputs": x.tolist()}, timeout=60).json()
    assert half["precision"] == "bf16"
    assert full["precision"] == "fp32"
    h, f = np.array(half["outputs"]), np.array(full["outputs"])
    np.testing.assert_allclose(h, f, atol=0.03 * np.abs(f).max(), rtol=0)
    assert (h.argmax(1) == f.argmax(1)).mean() >= 0.97


def test_fp16_serves_and_agrees_with_fp32(server_factory: StartServer, fp32_server: ServerProcess) -> None:
    rows = ["--max-batch-size", "8", "--max-request-rows", "16"]
    fp16 = server_factory(SHIPPED_STORE, "--models", MODEL, "--precision", "fp16", *rows)
    listing = httpx.get(f"{fp16.url}/models").json()["models"][0]
    assert listing["weight_dtype"] == "float16"
    x = samples(16, seed=3)
    half = httpx.post(f"{fp16.url}/predict", json={"inputs": x.tolist()}, timeout=60).json()
    full = httpx.post(f"{fp32_server.url}/predict", json={"inputs": x.tolist()}).json()
    assert half["precision"] == "fp16"
    h, f = np.array(half["outputs"]), np.array(full["outputs"])
    np.testing.assert_allclose(h, f, atol=0.01 * np.abs(f).max(), rtol=0)
    fp16.stop()


def test_bad_requests_get_4xx_and_the_server_keeps_serving(default_server: ServerProcess) -> None:
    url = default_server.url
    bad = [
        b"{not json",
        b'{"inputs": [[1, 2]]}',
        b'{"inputs": []}',
        b'{"inputs": [["a"]]}',
        b'{"model": "x", "inputs": [[1]]}',
    ]
    for body in bad:
        r = httpx.post(f"{url}/predict", content=body, headers={"content-type": "application/json"})
        assert 400 <= r.status_code < 500, (body, r.text)
        assert r.json()["error"], (body, r.text)
    x = samples(4, seed=4)
    r = httpx.post(f"{url}/predict", json={"inputs": x.tolist()})
    assert r.status_code == 200
    assert len(r.json()["outputs"]) == 4


def test_bad_store_fails_at_start_naming_file_and_field(tmp_path: Path) -> None:
    import shutil
    import subprocess
    import sys

    shutil.copytree(SHIPPED_STORE / MODEL, tmp_path / MODEL)
    cfg = tmp_path / MODEL / "config.json"
    cfg.write_text(cfg.read_text().replace('"max_batch_size": ', '"max_batch_size": -'))
    r = subprocess.run(
        [sys.executable, "-m", "halfserve", "serve", "--store", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2
    assert str(cfg) in r.stderr
    assert "batching.max_batch_size" in r.stderr
