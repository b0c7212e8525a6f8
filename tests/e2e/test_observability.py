"""A real server with JSON logs: request ids in headers and log lines, /metrics over HTTP, the status page, and a
precision switch while client threads keep sending requests."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import ServerProcess, save_tiny_mlp

pytestmark = pytest.mark.slow

StartServer = Callable[..., ServerProcess]
TOKEN = "e2e-observability-token"


@pytest.fixture(scope="module")
def server(server_factory: StartServer, tmp_path_factory: pytest.TempPathFactory) -> ServerProcess:
    root: Path = tmp_path_factory.mktemp("observability-store")
    save_tiny_mlp(root)
    args = ("--precision", "bf16", "--log-format", "json", "--access-log", "--admin-token", TOKEN)
    return server_factory(root, *args)


def log_entries(server: ServerProcess) -> list[dict[str, object]]:
    lines = server.log.read_text().splitlines()
    return [json.loads(line) for line in lines if line.startswith("{")]


def test_precision_switch_under_concurrent_http_traffic(server: ServerProcess) -> None:
    stop = threading.Event()
    results: list[tuple[int, str]] = []
    lock = threading.Lock()

    def send() -> None:
        with httpx.Client(base_url=server.url, timeout=30) as client:
            while not stop.is_set():
                r = client.post("/predict", json={"inputs": [[0.5] * 16] * 3})
                with lock:
                    results.append((r.status_code, r.json().get("precision", r.text)))

    def answered_in(precision: str, since: int, count: int = 10) -> None:
        """Wait until ``count`` answers after the ``since``-th were computed in ``precision``."""
        deadline = time.monotonic() + 30
        while sum(p == precision for _, p in results[since:]) < count:
            assert time.monotonic() < deadline, f"no {precision} answers after the switch"
            time.sleep(0.01)

    threads = [threading.Thread(target=send) for _ in range(6)]
    for t in threads:
        t.start()
    try:
        with httpx.Client(base_url=server.url, timeout=60, headers={"Authorization": f"Bearer {TOKEN}"}) as admin:
            for precision in ("fp32", "bf16", "fp32", "bf16"):
                r = admin.post("/models/tiny/precision", json={"precision": precision})
                assert (r.status_code, r.json()["precision"]) == (200, precision)
                answered_in(precision, len(results))
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert results
    assert [r for r in results if r[0] != 200] == []
    assert {"fp32", "bf16"} <= {p for _, p in results}

    text = httpx.get(f"{server.url}/metrics").text
    answered = sum(
        s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "halfserve_requests_total" and s.labels["model"] == "tiny"
    )
    rows = sum(
        s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "halfserve_inference_count_total"
    )
    assert answered == len(results)
    assert rows == 3 * len(results)


def test_request_id_travels_from_header_to_log_line(server: ServerProcess) -> None:
    r = httpx.post(f"{server.url}/predict", json={"inputs": [[0.5] * 15]}, headers={"X-Request-Id": "trace-e2e-7"})
    assert (r.status_code, r.headers["x-request-id"]) == (400, "trace-e2e-7")
    ok = httpx.post(f"{server.url}/v2/models/tiny/infer", json={"inputs": []})
    generated = ok.headers["x-request-id"]
    entries = log_entries(server)
    mine = [e for e in entries if e.get("request_id") == "trace-e2e-7"]
    assert len(mine) == 1
    assert (mine[0]["logger"], mine[0]["status"], mine[0]["model"], mine[0]["path"]) == (
        "halfserve.access",
        400,
        "tiny",
        "/predict",
    )
    assert any(e.get("request_id") == generated for e in entries)
    # uvicorn's own lines are JSON too, and inference requests are not logged twice.
    assert any(e["logger"] == "uvicorn.error" for e in entries)
    assert not any(e["logger"] == "uvicorn.access" and "/predict" in str(e["message"]) for e in entries)


def test_status_page_and_metrics_are_served(server: ServerProcess) -> None:
    page = httpx.get(f"{server.url}/")
    metrics = httpx.get(f"{server.url}/metrics")
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
    assert "<title>halfserve status</title>" in page.text
    assert 'fetch("/models")' in page.text
    assert metrics.headers["content-type"].startswith("text/plain")
    assert 'halfserve_model_weight_bytes{device="cpu",dtype="bfloat16",model="tiny"' in metrics.text
