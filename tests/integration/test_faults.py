"""The app in-process under faults: a full queue, deadlines, a failing request, out of memory, fp16 overflow."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path

import httpx
import numpy as np
import orjson
import pytest
import torch

from halfserve import store
from halfserve.app import begin_drain
from halfserve.execution import Batching
from halfserve.manifest import OverflowPolicy
from halfserve.served import ServedModel
from halfserve.serving import Outcome
from halfserve.settings import Settings
from tests.conftest import save_tiny_mlp
from tests.fault_models import Poisonable, save_overflowing_linear
from tests.integration.conftest import serving
from tests.waiting import until

HEADER = "Inference-Header-Content-Length"
ROW = [0.5] * 16


def served(client: httpx.AsyncClient, name: str = "tiny") -> ServedModel:
    app = client._transport.app  # type: ignore[attr-defined]
    model: ServedModel = app.state.serving.repository.models[name]
    return model


class Gate:
    """Holds every batch of a model at the runner until opened; records the row count of each batch."""

    def __init__(self, model: ServedModel) -> None:
        assert model.batcher is not None
        self.batcher = model.batcher
        self.inner: Callable[[list[np.ndarray]], Awaitable[Sequence[Outcome]]] = model.batcher.runner
        self.open = asyncio.Event()
        self.entered = asyncio.Event()
        self.sizes: list[int] = []
        model.batcher.runner = self

    async def __call__(self, chunks: list[np.ndarray]) -> Sequence[Outcome]:
        self.sizes.append(sum(len(c) for c in chunks))
        self.entered.set()
        await self.open.wait()
        return await self.inner(chunks)


@contextlib.asynccontextmanager
async def gated(settings: Settings) -> AsyncIterator[tuple[httpx.AsyncClient, Gate]]:
    async with serving(settings) as client:
        yield client, Gate(served(client))


def v2_json(x: np.ndarray, **fields: object) -> dict[str, object]:
    tensor = {"name": "features", "shape": list(x.shape), "datatype": "FP32", "data": x.ravel().tolist()}
    return {"inputs": [tensor], **fields}


# Back-pressure and deadlines ------------------------------------------------------------------------------------


async def test_a_full_queue_answers_503_with_retry_after_at_once_on_both_apis(tiny_store: Path) -> None:
    settings = Settings(
        store=tiny_store,
        precision="fp32",
        max_batch_size=2,
        max_queue_rows=4,
        max_delay_ms=0,
        max_request_rows=4,
    )
    async with gated(settings) as (client, gate):
        running = asyncio.ensure_future(client.post("/predict", json={"inputs": [ROW, ROW]}))
        await gate.entered.wait()
        queued = asyncio.ensure_future(client.post("/predict", json={"inputs": [ROW] * 4}))
        await until(lambda: served(client).batcher.queued_rows >= 4, "4 rows queued")  # type: ignore[union-attr]
        # Answered while the running batch is still held at the gate: at once, not after it.
        full_predict = await client.post("/predict", json={"inputs": [ROW]})
        full_v2 = await client.post("/v2/models/tiny/infer", json=v2_json(np.zeros((1, 16), np.float32)))
        for r in (full_predict, full_v2):
            assert r.status_code == 503, r.text
            assert r.headers["retry-after"] == "1"
            assert "queue full" in r.json()["error"]
        gate.open.set()
        assert (await running).status_code == 200
        assert (await queued).status_code == 200
        stats = (await client.get("/models/tiny/stats")).json()
    assert stats["rejected"] == 2
    assert stats["queued_rows"] == 0


async def test_a_request_larger_than_the_queue_is_413_not_503(tiny_store: Path) -> None:
    async with serving(Settings(store=tiny_store, max_queue_rows=8, max_request_rows=100)) as client:
        r = await client.post("/predict", json={"inputs": [ROW] * 9})
    assert r.status_code == 413, r.text
    assert r.json()["error"] == "inputs: 9 rows exceed the limit of 8 per request (the model's max_queue_rows)"


async def test_deadline_header_answers_504_on_time_and_the_request_never_runs(tiny_store: Path) -> None:
    settings = Settings(store=tiny_store, precision="fp32", max_batch_size=2, max_delay_ms=0)
    async with gated(settings) as (client, gate):
        running = asyncio.ensure_future(client.post("/predict", json={"inputs": [ROW, ROW]}))
        await gate.entered.wait()
        start = time.monotonic()
        late = await client.post("/predict", json={"inputs": [ROW]}, headers={"X-Request-Timeout-Ms": "50"})
        elapsed = time.monotonic() - start
        late_v2 = await client.post(
            "/v2/models/tiny/infer", json=v2_json(np.zeros((1, 16), np.float32), parameters={"timeout": 50_000})
        )
        gate.open.set()
        assert (await running).status_code == 200
        stats = (await client.get("/models/tiny/stats")).json()
    assert late.status_code == 504, late.text
    assert "deadline passed" in late.json()["error"]
    assert elapsed > 0.04  # answered at its deadline, while the running batch was still held at the gate
    assert late_v2.status_code == 504, late_v2.text
    assert gate.sizes == [2]  # neither expired request ever reached the model
    assert stats["expired"] == 2


async def test_configured_request_timeout_applies_and_a_client_may_only_shorten_it(tmp_path: Path) -> None:
    save_tiny_mlp(tmp_path, batching=Batching(max_batch_size=2, max_delay_ms=0, request_timeout_ms=60))
    async with gated(Settings(store=tmp_path, precision="fp32")) as (client, gate):
        running = asyncio.ensure_future(client.post("/predict", json={"inputs": [ROW, ROW]}))
        await gate.entered.wait()
        start = time.monotonic()
        # The client asks for longer than the model allows: the model's 60 ms win.
        r = await client.post("/predict", json={"inputs": [ROW]}, headers={"X-Request-Timeout-Ms": "60000"})
        assert r.status_code == 504, r.text
        # Not the client's 60 s: a bound no host is slow enough to reach, and half what the client asked for.
        assert time.monotonic() - start < 30
        gate.open.set()
        assert (await running).status_code == 200
        listing = (await client.get("/models")).json()["models"][0]
        config = (await client.get("/v2/models/tiny/config")).json()
    assert listing["batching"]["request_timeout_ms"] == 60
    assert config["dynamic_batching"]["default_queue_policy"] == {
        "timeout_action": "REJECT",
        "default_timeout_microseconds": 60_000,
        "allow_timeout_override": True,
    }


# A decimal number only: Python's float() also read "1_000", "1e3", "+5" and " 5".
@pytest.mark.parametrize("value", ["0", "-5", "soon", "nan", "inf", "1e12", "1_000", "1e3", "+5", "5.", "3600000.5"])
async def test_a_malformed_deadline_header_is_a_400_naming_it(tiny_store: Path, value: str) -> None:
    async with serving(Settings(store=tiny_store)) as client:
        r = await client.post("/predict", json={"inputs": [ROW]}, headers={"X-Request-Timeout-Ms": value})
        v2 = await client.post(
            "/v2/models/tiny/infer",
            json=v2_json(np.zeros((1, 16), np.float32)),
            headers={"X-Request-Timeout-Ms": value},
        )
    for resp in (r, v2):
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"].startswith("X-Request-Timeout-Ms: expected milliseconds")


async def test_a_deadline_given_twice_is_a_400_and_a_fractional_one_names_the_range(tiny_store: Path) -> None:
    x = np.zeros((1, 16), np.float32)
    async with serving(Settings(store=tiny_store)) as client:
        twice = await client.post(
            "/predict", json={"inputs": [ROW]}, headers=[("X-Request-Timeout-Ms", "1"), ("X-Request-Timeout-Ms", "9")]
        )
        fractional = [
            await client.post("/v2/models/tiny/infer", json=v2_json(x, parameters={"timeout": value}))
            for value in (1.5, 1e20)
        ]
    # The first was used, silently: a proxy's shorter deadline appended after the client's was lost.
    assert twice.status_code == 400
    assert twice.json()["error"] == "X-Request-Timeout-Ms: given 2 times; send it once"
    assert [r.json()["error"] for r in fractional] == [
        "parameters.timeout: expected microseconds in [0, 3600000000], got 1.5",
        "parameters.timeout: expected microseconds in [0, 3600000000], got 1e+20",
    ]


async def test_a_deadline_header_in_utf_8_is_quoted_as_sent(tiny_store: Path) -> None:
    async with serving(Settings(store=tiny_store)) as client:
        r = await client.post("/predict", json={"inputs": [ROW]}, headers=[("X-Request-Timeout-Ms", "５０".encode())])
    assert r.status_code == 400
    assert r.json()["error"] == "X-Request-Timeout-Ms: expected milliseconds in (0, 3600000], got '５０'"


@pytest.mark.parametrize(("micros", "status"), [(3_600_000_000, 200), (3_600_000_001, 400), (2**64 - 1, 400)])
async def test_parameters_timeout_is_held_to_the_hour_the_header_is(tiny_store: Path, micros: int, status: int) -> None:
    async with serving(Settings(store=tiny_store)) as client:
        x = np.zeros((1, 16), np.float32)
        r = await client.post("/v2/models/tiny/infer", json=v2_json(x, parameters={"timeout": micros}))
        ms = await client.post("/predict", json={"inputs": [ROW]}, headers={"X-Request-Timeout-Ms": str(micros / 1000)})
    assert (r.status_code, ms.status_code) == (status, status), (r.text, ms.text)
    if status == 400:
        assert r.json()["error"] == f"parameters.timeout: expected microseconds in [0, 3600000000], got {micros}"


# Fault isolation -------------------------------------------------------------------------------------------------


@pytest.mark.instance_threads
async def test_a_request_that_breaks_the_model_fails_alone_with_a_500_naming_the_cause(tiny_store: Path) -> None:
    async with serving(Settings(store=tiny_store, precision="fp32", max_delay_ms=100)) as client:
        engine = served(client).engine
        assert engine is not None
        fake = Poisonable(engine.model)
        engine.model = fake
        x = np.random.default_rng(0).standard_normal((7, 16)).astype(np.float32)
        bodies = [{"inputs": [row.tolist()]} for row in x]
        bodies.insert(2, {"inputs": [[666.0] * 16]})
        responses = await asyncio.gather(*(client.post("/predict", json=b) for b in bodies))
        stats = (await client.get("/models/tiny/stats")).json()
    statuses = [r.status_code for r in responses]
    assert statuses == [200, 200, 500, 200, 200, 200, 200, 200], [r.text for r in responses]
    assert responses[2].json()["error"] == "inference failed: ValueError: poisoned input (666.0)"
    assert fake.sizes[0] == 8  # all eight shared one batch first
    want = fake.inner(torch.from_numpy(x)).detach().numpy()
    got = np.array([r.json()["outputs"][0] for i, r in enumerate(responses) if i != 2])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert stats["split_retries"] >= 1


@pytest.mark.instance_threads
async def test_out_of_memory_shrinks_the_batch_size_and_fails_nobody(tiny_store: Path) -> None:
    async with serving(Settings(store=tiny_store, precision="fp32", max_delay_ms=100, max_batch_size=16)) as client:
        engine = served(client).engine
        assert engine is not None
        engine.model = Poisonable(engine.model, oom_above=4)
        responses = await asyncio.gather(*(client.post("/predict", json={"inputs": [ROW]}) for _ in range(16)))
        stats = (await client.get("/models/tiny/stats")).json()
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses if r.status_code != 200]
    assert stats["max_batch_size"] == 4
    assert stats["configured_max_batch_size"] == 16
    assert stats["oom_shrinks"] == 2


# fp16 overflow ---------------------------------------------------------------------------------------------------

BIG = [100.0] * 4
SMALL = [1.0] * 4


def fp32_outputs(store_dir: Path, name: str, x: list[list[float]]) -> np.ndarray:
    loaded = store.load(store_dir, name)
    with torch.inference_mode():
        return loaded.module(torch.tensor(x)).numpy()


async def test_overflow_rerun_fp32_serves_fp32_outputs_says_so_and_counts_it(tmp_path: Path) -> None:
    save_overflowing_linear(tmp_path, "hot", OverflowPolicy.RERUN_FP32)
    async with serving(Settings(store=tmp_path, max_delay_ms=50)) as client:
        big, small = await asyncio.gather(
            client.post("/predict", json={"inputs": [BIG]}), client.post("/predict", json={"inputs": [SMALL]})
        )
        v2 = await client.post(
            "/v2/models/hot/infer",
            json={"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": BIG}]},
        )
        stats = (await client.get("/models/hot/stats")).json()
        histogram = stats["batch_size_histogram"]
    assert big.status_code == small.status_code == v2.status_code == 200
    assert big.json()["precision"] == "fp32"
    assert small.json()["precision"] == "fp16"  # shared the batch, was not rerun
    want = fp32_outputs(tmp_path, "hot", [BIG])
    np.testing.assert_array_equal(np.array(big.json()["outputs"], np.float32), want)  # bit for bit: it ran in fp32
    assert big.json()["outputs"][0][0] == 80000.0
    assert v2.json()["parameters"] == {"precision": "fp32"}
    assert v2.json()["outputs"][0]["data"][0] == 80000.0
    assert histogram == {"2": 1, "1": 1}
    assert (stats["fp32_reruns"], stats["overflows"], stats["overflow_policy"]) == (2, 2, "rerun_fp32")


async def test_a_request_spanning_batches_reports_each_precision_that_served_it(tmp_path: Path) -> None:
    save_overflowing_linear(tmp_path, "hot", OverflowPolicy.RERUN_FP32)
    async with serving(Settings(store=tmp_path, max_batch_size=2, max_request_rows=3)) as client:
        r = await client.post("/predict", json={"inputs": [SMALL, SMALL, BIG]})
    assert r.status_code == 200, r.text
    assert r.json()["precision"] == "fp16+fp32"


async def test_overflow_error_policy_is_a_500_naming_the_overflow(tmp_path: Path) -> None:
    save_overflowing_linear(tmp_path, "hot", OverflowPolicy.ERROR)
    async with serving(Settings(store=tmp_path, max_delay_ms=50)) as client:
        big, small = await asyncio.gather(
            client.post("/predict", json={"inputs": [BIG]}), client.post("/predict", json={"inputs": [SMALL]})
        )
    assert big.status_code == 500
    assert "PrecisionOverflowError: fp16 overflow" in big.json()["error"]
    assert small.status_code == 200
    assert small.json()["precision"] == "fp16"


async def test_overflow_allow_policy_returns_infinity_as_null_in_json_and_exactly_in_binary(tmp_path: Path) -> None:
    save_overflowing_linear(tmp_path, "hot", OverflowPolicy.ALLOW)
    body = {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": BIG}]}
    async with serving(Settings(store=tmp_path)) as client:
        as_json = await client.post("/predict", json={"inputs": [BIG]})
        v2_json = await client.post("/v2/models/hot/infer", json=body)
        binary = await client.post("/v2/models/hot/infer", json={**body, "parameters": {"binary_data_output": True}})
    assert as_json.status_code == 200
    assert as_json.json()["precision"] == "fp16"
    assert as_json.json()["outputs"][0][0] is None  # JSON has no infinity: orjson writes null
    assert v2_json.json()["outputs"][0]["data"][0] is None
    n = int(binary.headers[HEADER])
    assert orjson.loads(binary.content[:n])["parameters"] == {"precision": "fp16"}
    assert np.isposinf(np.frombuffer(binary.content[n:], np.float32)[0])


# Readiness while draining ----------------------------------------------------------------------------------------


async def test_draining_turns_readiness_off_but_keeps_answering_inference(tiny_store: Path) -> None:
    async with serving(Settings(store=tiny_store)) as client:
        begin_drain(client._transport.app)  # type: ignore[attr-defined]
        ready = await client.get("/ready")
        v2_ready = await client.get("/v2/health/ready")
        predict = await client.post("/predict", json={"inputs": [ROW]})
    assert ready.status_code == 503
    assert "draining" in ready.json()["error"]
    assert v2_ready.status_code == 400
    assert predict.status_code == 200
