"""GET /metrics after known traffic: the counters and histograms add up to what was sent and what the batcher did."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from halfserve.manifest import OverflowPolicy
from halfserve.settings import Settings
from tests.conftest import save_tiny_mlp
from tests.fault_models import save_overflowing_linear
from tests.integration.conftest import serving

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


async def scrape(client: httpx.AsyncClient) -> Samples:
    r = await client.get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(r.text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def total(samples: Samples, name: str, **labels: str) -> float:
    """Sum of ``name`` over every series whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= set(ls))


def buckets(samples: Samples, name: str, **labels: str) -> list[tuple[float, float]]:
    want = set(labels.items())
    out = [
        (float(dict(ls)["le"]), v)
        for (n, ls), v in samples.items()
        if n == f"{name}_bucket" and want <= set(ls) and set(ls) - {("le", dict(ls)["le"])} == want
    ]
    return sorted(out)


def v2_body(rows: int) -> dict[str, object]:
    return {"inputs": [{"name": "features", "datatype": "FP32", "shape": [rows, 16], "data": [0.25] * (rows * 16)}]}


async def test_counters_and_histograms_add_up_after_known_traffic(tiny_store: Path) -> None:
    rng = np.random.default_rng(0)
    predict_rows = [int(n) for n in rng.integers(1, 4, size=24)]
    v2_rows = [int(n) for n in rng.integers(1, 4, size=12)]
    async with serving(Settings(store=tiny_store, precision="bf16", max_delay_ms=20)) as client:
        # Warm-up traffic is not counted: it never passes the batcher.
        before = await scrape(client)
        assert total(before, "halfserve_requests_total") == 0
        assert value(before, "halfserve_models_loaded") == 1
        calls = [client.post("/predict", json={"model": "tiny", "inputs": [[0.5] * 16] * n}) for n in predict_rows]
        calls += [client.post("/v2/models/tiny/infer", json=v2_body(n)) for n in v2_rows]
        calls += [client.post("/predict", json={"model": "tiny", "inputs": [[0.5] * 3]}) for _ in range(3)]  # 400
        calls += [client.post("/predict", json={"model": "nope", "inputs": [[0.5] * 16]}) for _ in range(2)]  # 404
        responses = await asyncio.gather(*calls)
        statuses = [r.status_code for r in responses]
        assert statuses == [200] * (len(predict_rows) + len(v2_rows)) + [400] * 3 + [404] * 2
        samples = await scrape(client)
        stats = (await client.get("/models/tiny/stats")).json()
        triton = (await client.get("/v2/models/tiny/stats")).json()["model_stats"][0]
        models = (await client.get("/models")).json()
        listing = models["models"][0]

    ok = {"model": "tiny", "precision": "bf16", "status": "200"}
    assert value(samples, "halfserve_requests_total", protocol="predict", **ok) == len(predict_rows)
    assert value(samples, "halfserve_requests_total", protocol="v2", **ok) == len(v2_rows)
    assert value(samples, "halfserve_request_rows_total", protocol="predict", **ok) == sum(predict_rows)
    assert value(samples, "halfserve_request_rows_total", protocol="v2", **ok) == sum(v2_rows)
    # A bad sample shape is the model's (400); an unknown model is nobody's, and its name never becomes a label.
    bad = {"model": "tiny", "precision": "bf16", "protocol": "predict", "status": "400"}
    assert value(samples, "halfserve_requests_total", **bad) == 3
    unknown = {"model": "", "precision": "", "protocol": "predict", "status": "404"}
    assert value(samples, "halfserve_requests_total", **unknown) == 2
    assert not any(dict(ls).get("model") == "nope" for _, ls in samples)
    assert total(samples, "halfserve_requests_total") == len(responses)

    # End-to-end latency: one observation per answered request, per protocol.
    for protocol, sent in (("predict", predict_rows), ("v2", v2_rows)):
        labels = {"model": "tiny", "precision": "bf16", "protocol": protocol}
        assert value(samples, "halfserve_request_duration_seconds_count", **labels) == len(sent)
        assert value(samples, "halfserve_request_duration_seconds_sum", **labels) > 0

    # Per batch: the histogram of batch sizes, Triton's counters and the batcher's own statistics agree.
    rows = sum(predict_rows) + sum(v2_rows)
    batches = value(samples, "halfserve_batch_size_count", model="tiny")
    assert batches == stats["batches"] == triton["execution_count"]
    assert value(samples, "halfserve_execution_count_total", model="tiny", version="1") == batches
    assert value(samples, "halfserve_batch_size_sum", model="tiny") == rows == stats["rows"]
    assert value(samples, "halfserve_inference_count_total", model="tiny", version="1") == rows
    assert batches < len(predict_rows) + len(v2_rows), "concurrent requests should have shared batches"
    sizes = buckets(samples, "halfserve_batch_size", model="tiny")
    counts = [c for _, c in sizes]
    assert counts == sorted(counts)
    assert sizes[-1] == (float("inf"), batches)
    exact = {int(size): n for size, n in stats["batch_size_histogram"].items()}
    for bound, count in sizes:  # cumulative: every batch of at most ``bound`` rows
        assert count == sum(n for size, n in exact.items() if size <= bound)
    assert value(samples, "halfserve_compute_duration_seconds_count", model="tiny", precision="bf16") == batches
    assert (
        value(samples, "halfserve_queue_duration_seconds_count", model="tiny")
        == triton["inference_stats"]["queue"]["count"]
    )
    queue_sum = value(samples, "halfserve_queue_duration_seconds_sum", model="tiny")
    assert abs(queue_sum - stats["queue_seconds"]) < 1e-6

    # What the model holds: bf16 weights are half the fp32 ones kept on the host.
    weights = {"model": "tiny", "version": "1", "precision": "bf16", "device": "cpu", "dtype": "bfloat16"}
    assert value(samples, "halfserve_model_weight_bytes", **weights) == listing["weight_bytes"] > 0
    assert value(samples, "halfserve_model_host_fp32_bytes", model="tiny", version="1") == 2 * listing["weight_bytes"]
    assert value(samples, "halfserve_queue_rows", model="tiny") == 0
    assert value(samples, "halfserve_model_state", model="tiny", version="1", state="ready") == 1
    assert value(samples, "halfserve_fp32_reruns_total", model="tiny") == 0
    # The status page's source: the listing carries the same statistics and the server's clock to time rates by.
    assert listing["stats"]["rows"] == rows
    assert listing["stats"]["succeeded"] == len(predict_rows) + len(v2_rows)
    assert isinstance(models["time"], float)


async def test_request_id_is_echoed_or_generated_on_answers_and_errors(tiny_store: Path) -> None:
    async with serving(Settings(store=tiny_store)) as client:
        given = await client.post("/predict", json={"inputs": [[0.5] * 16]}, headers={"X-Request-Id": "req-42"})
        failed = await client.post("/v2/models/tiny/infer", json={"inputs": []}, headers={"X-Request-Id": "req-43"})
        fresh = [await client.post("/predict", json={"inputs": [[0.5] * 16]}) for _ in range(2)]
        unprintable = await client.post("/predict", json={"inputs": [[0.5] * 16]}, headers={"X-Request-Id": "a\tb"})
    assert (given.status_code, given.headers["x-request-id"]) == (200, "req-42")
    assert (failed.status_code, failed.headers["x-request-id"]) == (400, "req-43")
    assert failed.json()["error"].startswith("inputs")
    ids = [r.headers["x-request-id"] for r in fresh]
    assert len(set(ids)) == 2
    assert all(ids)
    assert unprintable.headers["x-request-id"] not in ("a\tb", *ids)


async def test_every_other_route_echoes_or_generates_a_request_id_too(tiny_store: Path) -> None:
    async with serving(Settings(store=tiny_store)) as client:
        listing = await client.get("/models", headers={"X-Request-Id": "ops-7"})
        missing = await client.get("/models/nope/stats", headers={"X-Request-Id": "ops-8"})
        health = [await client.get("/health") for _ in range(2)]
        metrics = await client.get("/metrics")
    assert (listing.status_code, listing.headers["x-request-id"]) == (200, "ops-7")
    assert (missing.status_code, missing.headers["x-request-id"]) == (404, "ops-8")
    ids = {r.headers["x-request-id"] for r in (*health, metrics)}
    assert len(ids) == 3
    assert all(ids)
    assert listing.headers.get_list("x-request-id") == ["ops-7"]  # once, not once per layer


async def test_metrics_of_two_models_stay_apart_and_survive_a_reload(tmp_path: Path) -> None:
    save_tiny_mlp(tmp_path, "one")
    save_tiny_mlp(tmp_path, "two", seed=1)
    settings = Settings(store=tmp_path, precision="fp32", admin_token="metrics-admin-token")
    auth = {"Authorization": "Bearer metrics-admin-token"}
    async with serving(settings) as client:
        for name, n in (("one", 3), ("two", 1)):
            for _ in range(n):
                assert (await client.post("/predict", json={"model": name, "inputs": [[0.1] * 16]})).status_code == 200
        assert (await client.post("/models/one/reload", headers=auth)).status_code == 200
        assert (await client.post("/predict", json={"model": "one", "inputs": [[0.1] * 16]})).status_code == 200
        samples = await scrape(client)
        stats = (await client.get("/models/one/stats")).json()
    ok = {"precision": "fp32", "protocol": "predict", "status": "200"}
    assert value(samples, "halfserve_requests_total", model="one", **ok) == 4
    assert value(samples, "halfserve_requests_total", model="two", **ok) == 1
    # Counters fed per batch outlive the reload; the batcher's own statistics start afresh with the new instance.
    assert value(samples, "halfserve_inference_count_total", model="one", version="1") == 4
    assert stats["rows"] == 1


async def test_fp32_reruns_are_counted_across_precision_switches(tmp_path: Path) -> None:
    save_overflowing_linear(tmp_path, "hot", OverflowPolicy.RERUN_FP32)
    auth = {"Authorization": "Bearer metrics-admin-token"}
    big = {"inputs": [[100.0] * 4]}  # 80,000 in output 0: past fp16's 65,504

    async with serving(Settings(store=tmp_path, admin_token="metrics-admin-token")) as client:
        first = await client.post("/predict", json=big)
        await client.post("/models/hot/precision", json={"precision": "fp32"}, headers=auth)
        native = await client.post("/predict", json=big)
        await client.post("/models/hot/precision", json={"precision": "fp16"}, headers=auth)
        second = await client.post("/predict", json=big)
        samples = await scrape(client)
    assert [r.json()["precision"] for r in (first, native, second)] == ["fp32"] * 3
    assert value(samples, "halfserve_fp32_reruns_total", model="hot") == 2
    assert value(samples, "halfserve_overflows_total", model="hot") == 2
    # Labelled by the precision that computed each answer: two reruns and one native fp32 forward.
    answered = {"model": "hot", "precision": "fp32", "protocol": "predict", "status": "200"}
    assert value(samples, "halfserve_requests_total", **answered) == 3
    assert value(samples, "halfserve_compute_duration_seconds_count", model="hot", precision="fp16") == 2
    assert value(samples, "halfserve_compute_duration_seconds_count", model="hot", precision="fp32") == 1
