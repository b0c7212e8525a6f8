"""Metrics, request ids and log lines, each on its own: no model, no server."""

from __future__ import annotations

import json
import logging
import sys

import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.requests import Request

from halfserve.api.http.telemetry import request_id
from halfserve.logs import EscapeControls, JsonFormatter, SkipInference
from halfserve.metrics import Metrics, observe_all
from halfserve.serving import Interface


def samples(m: Metrics) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for f in text_string_to_metric_families(m.render().decode())
        for s in f.samples
    }


def test_a_request_counts_rows_and_latency_only_when_answered() -> None:
    m = Metrics()
    m.request("a", "fp16", Interface.V2, 200, 3, 0.004)
    m.request("a", "fp16", Interface.V2, 200, 2, 0.030)
    m.request("a", "fp16", Interface.V2, 504, 7, 1.0)
    got = samples(m)
    ok = frozenset({"model": "a", "precision": "fp16", "protocol": "v2", "status": "200"}.items())
    late = frozenset({"model": "a", "precision": "fp16", "protocol": "v2", "status": "504"}.items())
    assert got[("halfserve_requests_total", ok)] == 2
    assert got[("halfserve_requests_total", late)] == 1
    assert got[("halfserve_request_rows_total", ok)] == 5
    assert ("halfserve_request_rows_total", late) not in got or got[("halfserve_request_rows_total", late)] == 0
    latency = frozenset({"model": "a", "precision": "fp16", "protocol": "v2"}.items())
    assert got[("halfserve_request_duration_seconds_count", latency)] == 2
    assert got[("halfserve_request_duration_seconds_sum", latency)] == pytest.approx(0.034)
    assert got[("halfserve_request_duration_seconds_bucket", latency | {("le", "0.005")})] == 1


def test_batch_observer_feeds_sizes_times_and_tritons_counts() -> None:
    m = Metrics()
    observer = m.batch_observer("a", 2, "bf16")
    for rows in (1, 3, 8):
        observer.queued([0.001] * rows)
        observer.ran(rows, 0.002)
    got = samples(m)
    a = frozenset({("model", "a")})
    assert got[("halfserve_batch_size_count", a)] == 3
    assert got[("halfserve_batch_size_sum", a)] == 12
    assert got[("halfserve_batch_size_bucket", a | {("le", "2.0")})] == 1
    assert got[("halfserve_batch_size_bucket", a | {("le", "4.0")})] == 2
    assert got[("halfserve_inference_count_total", a | {("version", "2")})] == 12
    assert got[("halfserve_execution_count_total", a | {("version", "2")})] == 3
    assert got[("halfserve_compute_duration_seconds_count", a | {("precision", "bf16")})] == 3
    assert got[("halfserve_queue_duration_seconds_count", a)] == 12
    assert got[("halfserve_queue_duration_seconds_sum", a)] == pytest.approx(0.012)
    assert got[("halfserve_queue_duration_seconds_bucket", a | {("le", "0.001")})] == 12


@pytest.mark.parametrize(
    "values",
    [
        [],
        [0.0007],
        [0.0, 0.0005, 0.001, 0.0011, 30.0, 31.0, 1e9, -1.0],  # on, just past and beyond the bounds; below zero
        [i / 997 for i in range(300)],
    ],
)
def test_observing_values_together_matches_observing_each(values: list[float]) -> None:
    one, together = Metrics(), Metrics()
    each = one.queue_time.labels("a")
    for v in values:
        each.observe(v)
    observe_all(together.queue_time.labels("a"), values)
    made = {k: v for k, v in samples(together).items() if not k[0].endswith("_created")}
    assert made == pytest.approx({k: v for k, v in samples(one).items() if not k[0].endswith("_created")})
    assert made[("halfserve_queue_duration_seconds_count", frozenset({("model", "a")}))] == len(values)


def test_two_apps_keep_separate_registries() -> None:
    one, two = Metrics(), Metrics()
    one.request("a", "fp32", Interface.PREDICT, 200, 1, 0.001)
    assert b'halfserve_requests_total{model="a"' in one.render()
    assert b'halfserve_requests_total{model="a"' not in two.render()


def test_a_requests_labels_are_resolved_once_not_per_request(monkeypatch: pytest.MonkeyPatch) -> None:
    # Resolving prometheus-client's labelled children costs several times what counting does (about 2 us a request
    # with them kept); what the cost depends on is counted here, not timed.
    m = Metrics()
    resolved: list[object] = []
    resolve = m._resolve
    monkeypatch.setattr(m, "_resolve", lambda key: resolved.append(key) or resolve(key))
    for _ in range(100):
        m.request("a", "fp16", Interface.PREDICT, 200, 1, 0.001)
        m.request("a", "fp16", Interface.PREDICT, 503, 1, 0.001)
    assert resolved == [("a", "fp16", Interface.PREDICT, 200), ("a", "fp16", Interface.PREDICT, 503)]
    assert b'halfserve_requests_total{model="a",precision="fp16",protocol="predict",status="200"} 100.0' in m.render()


def scope_request(headers: list[tuple[bytes, bytes]]) -> Request:
    return Request({"type": "http", "method": "POST", "path": "/predict", "headers": headers})


def test_request_id_takes_a_sane_client_id_and_replaces_others() -> None:
    assert request_id(scope_request([(b"x-request-id", b"abc-1")])) == b"abc-1"
    fresh = {request_id(scope_request([])) for _ in range(3)}
    assert len(fresh) == 3
    for bad in (b"", b"x" * 129, "é".encode(), b"a\x01b"):
        assert request_id(scope_request([(b"x-request-id", bad)])) != bad


def test_json_formatter_writes_extra_fields_and_the_exception() -> None:
    record = logging.LogRecord("halfserve.access", logging.WARNING, __file__, 1, "POST %s %d", ("/predict", 500), None)
    record.request_id = "r-1"
    record.status = 500
    try:
        raise ValueError("boom")
    except ValueError:
        record.exc_info = sys.exc_info()
    line = JsonFormatter().format(record)
    entry = json.loads(line)
    assert "\n" not in line
    assert entry["message"] == "POST /predict 500"
    assert (entry["level"], entry["logger"], entry["request_id"], entry["status"]) == (
        "WARNING",
        "halfserve.access",
        "r-1",
        500,
    )
    assert "ValueError: boom" in entry["exception"]
    assert entry["time"].endswith("Z")


@pytest.mark.parametrize(
    ("method", "path", "kept"),
    [("POST", "/predict", False), ("POST", "/v2/models/m/infer?x=1", False), ("GET", "/ready", True)],
)
def test_uvicorn_access_lines_of_inference_requests_are_dropped(method: str, path: str, kept: bool) -> None:
    args = ("127.0.0.1:1", method, path, "1.1", 200)
    record = logging.LogRecord("uvicorn.access", logging.INFO, __file__, 1, '%s - "%s %s HTTP/%s" %d', args, None)
    assert SkipInference().filter(record) is kept


def test_control_characters_of_an_access_line_s_arguments_are_escaped() -> None:
    """uvicorn's access line quotes the decoded path: ``%0d%0a`` in it had started a line of the client's own in a text
    log."""
    forged = "/predictions/x\r\n2026-11-29 10:00:00,000 CRITICAL halfserve.app: FORGED\u2028"
    args = ("127.0.0.1:1", "POST", forged, "1.1", 404)
    record = logging.LogRecord("uvicorn.access", logging.INFO, __file__, 1, '%s - "%s %s HTTP/%s" %d', args, None)
    assert EscapeControls().filter(record) is True
    line = logging.Formatter("%(message)s").format(record)
    assert line.splitlines() == [line]
    assert "/predictions/x\\x0d\\x0a2026-11-29 10:00:00,000 CRITICAL halfserve.app: FORGED\\u2028" in line
    assert record.args[4] == 404  # type: ignore[index]  # not a string: as it was
