"""The load test's pure pieces: percentiles, aggregation, ratios, request bodies, URL checks, options."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import orjson
import pytest

from halfserve import grpc_messages
from halfserve.cli import build_parser
from halfserve.cli import main as cli_main
from halfserve.loadtest import LoadtestError
from halfserve.loadtest.cli import config_from_args
from halfserve.loadtest.client import split
from halfserve.loadtest.config import LoadtestConfig, default_precisions
from halfserve.loadtest.payload import (
    HEADER_LENGTH,
    MAX_BODIES,
    MAX_REQUEST_ELEMENTS,
    Protocol,
    RequestTemplate,
    Signature,
    build_template,
    check_signature,
    encode_body,
    load_samples,
    random_sample_count,
    random_samples,
    served_precision,
)
from halfserve.loadtest.stats import (
    LevelSample,
    ServerDelta,
    latency_summary,
    percentile,
    summarize,
    throughput_ratios,
)
from halfserve.loadtest.target import check_url, grpc_target, is_local_host

SIG = Signature(name="features", datatype="FP32", shape=(3,))


# Percentiles and aggregation ------------------------------------------------------------------------------------


def test_percentile_is_nearest_rank() -> None:
    values = np.arange(1.0, 101.0)  # 1..100
    assert percentile(values, 50) == 50.0
    assert percentile(values, 90) == 90.0
    assert percentile(values, 99) == 99.0
    assert percentile(values, 100) == 100.0
    assert percentile(np.array([7.0]), 1) == 7.0
    assert percentile(np.array([1.0, 2.0]), 50) == 1.0
    assert percentile(np.array([1.0, 2.0]), 51) == 2.0


@pytest.mark.parametrize("q", [0, -1, 100.5])
def test_percentile_rejects_out_of_range_q(q: float) -> None:
    with pytest.raises(ValueError, match="q must be"):
        percentile(np.array([1.0]), q)


def test_percentile_of_nothing_is_an_error() -> None:
    with pytest.raises(ValueError, match="no values"):
        percentile(np.array([]), 50)


def test_latency_summary_is_ordered_and_in_ms() -> None:
    lat = np.random.default_rng(0).exponential(0.01, size=1000)
    s = latency_summary(lat)
    assert s["p50_ms"] is not None
    assert s["p90_ms"] is not None
    assert s["p99_ms"] is not None
    assert s["p50_ms"] <= s["p90_ms"] <= s["p99_ms"] <= s["max_ms"]  # type: ignore[operator]
    assert s["max_ms"] == pytest.approx(lat.max() * 1000)
    assert s["mean_ms"] == pytest.approx(lat.mean() * 1000)
    assert all(v is None for v in latency_summary(np.empty(0)).values())


def sample(successes: int = 90, elapsed: float = 2.0, cpu: float = 0.5, **errors: dict[str, int]) -> LevelSample:
    return LevelSample(
        latencies=np.full(successes, 0.004),
        errors_by_status=errors.get("status", {"503": 6}),
        errors_by_exception=errors.get("exceptions", {"ReadTimeout": 4}),
        elapsed_s=elapsed,
        client_cpu_s=cpu,
    )


def test_summarize_counts_add_up() -> None:
    r = summarize(
        sample(),
        precision="bf16",
        served_precision="bf16",
        protocol="predict",
        concurrency=8,
        rows_per_request=4,
        server=ServerDelta(rows=360, batches=45, cpu_s=1.0),
    )
    assert (r.requests, r.successes, r.errors) == (100, 90, 10)
    assert r.requests == r.successes + r.errors
    assert r.errors_by_status == {"503": 6}
    assert r.errors_by_exception == {"ReadTimeout": 4}
    assert r.rows == 90 * 4
    assert r.req_per_s == pytest.approx(50.0)
    assert r.rows_per_s == pytest.approx(180.0)
    assert r.mean_batch_size == pytest.approx(8.0)
    assert r.p50_ms == pytest.approx(4.0)
    assert r.client_cpu_percent == pytest.approx(25.0)
    assert r.client_cpu_us_per_request == pytest.approx(5000.0)
    assert r.server_cpu_percent == pytest.approx(50.0)
    assert r.server_cpu_us_per_request == pytest.approx(10000.0)
    assert not r.client_bound
    json.dumps(r.to_dict())


def test_summarize_without_server_stats_or_successes() -> None:
    r = summarize(
        sample(successes=0),
        precision="fp32",
        served_precision=None,
        protocol="v2-json",
        concurrency=1,
        rows_per_request=1,
    )
    assert r.requests == r.errors == 10
    assert r.p99_ms is None
    assert r.mean_batch_size is None
    assert r.server_cpu_percent is None


def test_server_delta_without_batches_has_no_mean() -> None:
    assert ServerDelta(rows=0, batches=0).mean_batch_size is None


@pytest.mark.parametrize(
    ("cpu", "ceiling", "bound"),
    [(0.5, None, False), (1.9, None, True), (0.5, 60.0, True), (0.5, 1000.0, False)],
)
def test_client_bound_by_cpu_or_ceiling(cpu: float, ceiling: float | None, bound: bool) -> None:
    # 100 requests in 2 s = 50 req/s; 1.9 s of CPU in 2 s is a saturated client.
    r = summarize(
        sample(cpu=cpu),
        precision="fp32",
        served_precision="fp32",
        protocol="predict",
        concurrency=4,
        rows_per_request=1,
        client_ceiling_rps=ceiling,
    )
    assert r.client_bound is bound


def test_level_sample_round_trips_and_merges() -> None:
    a = LevelSample(np.array([0.001, 0.002]), {"503": 1}, {}, elapsed_s=1.0, client_cpu_s=0.2)
    b = LevelSample(np.array([0.003]), {"503": 2, "500": 1}, {"ConnectError": 1}, elapsed_s=1.5, client_cpu_s=0.3)
    back = LevelSample.from_message(orjson.loads(orjson.dumps(a.to_message())))
    assert np.array_equal(back.latencies, a.latencies)
    assert back.errors_by_status == a.errors_by_status
    assert back.elapsed_s == a.elapsed_s
    merged = LevelSample.merge([a, b])
    assert merged.successes == 3
    assert merged.errors_by_status == {"503": 3, "500": 1}
    assert merged.errors_by_exception == {"ConnectError": 1}
    assert merged.requests == 8
    assert merged.elapsed_s == 1.5
    assert merged.client_cpu_s == pytest.approx(0.5)
    assert merged.processes == 2


def result(precision: str, concurrency: int, seconds: float) -> object:
    return summarize(
        LevelSample(np.full(100, 0.01), elapsed_s=seconds),
        precision=precision,
        served_precision=precision,
        protocol="predict",
        concurrency=concurrency,
        rows_per_request=1,
    )


def test_throughput_ratios_against_fp32_per_level() -> None:
    results = [result("bf16", 1, 1.0), result("bf16", 8, 0.5), result("fp32", 1, 2.0), result("fp32", 8, 2.0)]
    ratios = throughput_ratios(results)  # type: ignore[arg-type]
    assert ratios == {"bf16/fp32": {"1": pytest.approx(2.0), "8": pytest.approx(4.0)}}
    assert [r.throughput_vs_fp32 for r in results] == pytest.approx([2.0, 4.0, 1.0, 1.0])  # type: ignore[attr-defined]


def test_throughput_ratios_need_fp32_and_the_same_level() -> None:
    assert throughput_ratios([result("bf16", 1, 1.0), result("fp16", 1, 1.0)]) == {}  # type: ignore[list-item]
    assert throughput_ratios([result("bf16", 2, 1.0), result("fp32", 1, 1.0)]) == {}  # type: ignore[list-item]


# Request bodies -------------------------------------------------------------------------------------------------


def test_predict_body() -> None:
    batch = np.array([[0.1, 0.2, 0.3], [1.0, 2.0, 3.0]])
    body, headers = encode_body(Protocol.PREDICT, "m", SIG, batch)
    assert headers == {"content-type": "application/json"}
    assert orjson.loads(body) == {"model": "m", "inputs": batch.tolist()}


def test_v2_json_body() -> None:
    batch = np.array([[0.1, 0.2, 0.3], [1.0, 2.0, 3.0]])
    body, headers = encode_body(Protocol.V2_JSON, "m", SIG, batch)
    assert headers == {"content-type": "application/json"}
    tensor = orjson.loads(body)["inputs"][0]
    assert tensor == {"name": "features", "shape": [2, 3], "datatype": "FP32", "data": batch.ravel().tolist()}


def test_v2_binary_body() -> None:
    batch = np.array([[0.1, 0.2, 0.3], [1.0, 2.0, 3.0]])
    body, headers = encode_body(Protocol.V2_BINARY, "m", SIG, batch)
    length = int(headers[HEADER_LENGTH.lower()])
    header = orjson.loads(body[:length])
    tensor = header["inputs"][0]
    assert tensor["shape"] == [2, 3]
    assert tensor["datatype"] == "FP32"
    assert tensor["parameters"]["binary_data_size"] == 2 * 3 * 4 == len(body) - length
    assert header["parameters"]["binary_data_output"] is True
    np.testing.assert_array_equal(np.frombuffer(body[length:], dtype="<f4").reshape(2, 3), batch.astype(np.float32))
    assert headers["content-type"] == "application/octet-stream"


def test_integer_inputs_travel_as_int64() -> None:
    sig = Signature("ids", "INT32", (2,))
    samples = random_samples(sig, 4)
    assert samples.dtype == np.int64
    assert samples.min() >= 0
    assert samples.max() <= 9
    body, headers = encode_body(Protocol.V2_BINARY, "m", sig, samples[:1])
    length = int(headers[HEADER_LENGTH.lower()])
    assert orjson.loads(body[:length])["inputs"][0]["datatype"] == "INT64"
    assert len(body) - length == 2 * 8


def test_uint8_images_travel_as_bytes() -> None:
    sig = Signature("pixels", "UINT8", (3, 8, 8))
    samples = random_samples(sig, 16)
    assert samples.min() >= 0
    assert samples.max() <= 255
    assert samples.max() > 9  # the whole byte range, not the small integers of an id input
    body, headers = encode_body(Protocol.V2_BINARY, "m", sig, samples[:2])
    length = int(headers[HEADER_LENGTH.lower()])
    assert orjson.loads(body[:length])["inputs"][0]["datatype"] == "UINT8"
    assert body[length:] == samples[:2].astype(np.uint8).tobytes()


def test_random_samples_are_seeded_and_in_range() -> None:
    a, b = random_samples(SIG, 5, seed=1), random_samples(SIG, 5, seed=1)
    np.testing.assert_array_equal(a, b)
    assert a.shape == (5, 3)
    assert a.min() >= 0
    assert a.max() < 1


def test_random_sample_count_is_bounded() -> None:
    assert random_sample_count(SIG, 1) == MAX_BODIES
    big = Signature("image", "FP32", (3, 224, 224))
    assert random_sample_count(big, 1) == (1 << 20) // (3 * 224 * 224)
    assert random_sample_count(big, 64) == 64  # never less than one request


def test_a_signature_past_the_bound_is_refused_before_allocating() -> None:
    check_signature("m", Signature("image", "FP32", (3, 224, 224)), 64)
    with pytest.raises(LoadtestError, match=r"model 'm': input 'x' declares shape \[40000, 40000\]"):
        check_signature("m", Signature("x", "FP32", (40000, 40000)), 1)
    # The bound is on a request: rows times a sample's values.
    side = int(MAX_REQUEST_ELEMENTS**0.5)
    check_signature("m", Signature("x", "FP32", (side, side)), 1)
    with pytest.raises(LoadtestError, match="2 row"):
        check_signature("m", Signature("x", "FP32", (side, side)), 2)
    with pytest.raises(LoadtestError, match="every dimension fixed and at least 1"):
        check_signature("m", Signature("x", "FP32", (-1, 3)), 1)


@pytest.mark.parametrize(
    "inputs",
    [
        [],
        [{"name": "x"}],
        [{"name": "x", "datatype": "FP32", "shape": "big"}],
        [{"name": "x", "datatype": "FP32", "shape": [1.5]}],
        [{"name": "x", "datatype": "FP32", "shape": [1] * 17}],
    ],
)
def test_a_malformed_listing_is_a_clear_error(inputs: list[dict[str, object]]) -> None:
    with pytest.raises(LoadtestError, match="model 'm': GET /models lists no usable input"):
        Signature.from_listing({"name": "m", "inputs": inputs})


@pytest.mark.parametrize("protocol", [p for p in Protocol if p is not Protocol.GRPC])
def test_template_cycles_samples_into_bodies(protocol: Protocol) -> None:
    samples = np.arange(15.0).reshape(5, 3)
    t = build_template(protocol, "m", SIG, samples, rows_per_request=2)
    assert len(t.bodies) == 3  # ceil(5 / 2)
    assert t.path == ("/predict" if protocol is Protocol.PREDICT else "/v2/models/m/infer")
    assert t.method == "POST"
    assert t.rows_per_request == 2
    if protocol is Protocol.PREDICT:
        last = orjson.loads(t.bodies[2])["inputs"]
        assert last == [samples[4].tolist(), samples[0].tolist()]  # wraps around
    assert RequestTemplate.from_message(orjson.loads(orjson.dumps(t.to_message()))) == t


def test_grpc_template_holds_serialized_infer_requests_for_its_target() -> None:
    samples = np.arange(15.0).reshape(5, 3)
    with pytest.raises(LoadtestError, match="gRPC address"):
        build_template(Protocol.GRPC, "m", SIG, samples, rows_per_request=2)
    t = build_template(Protocol.GRPC, "m", SIG, samples, rows_per_request=2, grpc_target="127.0.0.1:9001")
    assert (t.method, t.path, t.grpc_target) == ("GRPC", "/inference.GRPCInferenceService/ModelInfer", "127.0.0.1:9001")
    last = grpc_messages.ModelInferRequest.FromString(t.bodies[2])
    assert last.model_name == "m"
    assert [(i.name, i.datatype, list(i.shape)) for i in last.inputs] == [(SIG.name, "FP32", [2, 3])]
    rows = np.frombuffer(last.raw_input_contents[0], dtype=np.float32).reshape(2, 3)
    np.testing.assert_array_equal(rows, samples[[4, 0]])  # wraps around
    assert RequestTemplate.from_message(orjson.loads(orjson.dumps(t.to_message()))) == t
    response = grpc_messages.ModelInferResponse(model_name="m")
    response.parameters["precision"].string_param = "bf16"
    assert served_precision(Protocol.GRPC, response.SerializeToString(), {}) == "bf16"
    assert served_precision(Protocol.GRPC, b"\xff\xff", {}) is None


@pytest.mark.parametrize(
    ("given", "base", "target"),
    [
        (None, "http://127.0.0.1:8000", "127.0.0.1:8001"),
        ("localhost:9001", "http://127.0.0.1:8000", "localhost:9001"),
        (None, "http://[::1]:8000", "[::1]:8001"),
    ],
)
def test_grpc_target_defaults_to_port_8001_of_the_url(given: str | None, base: str, target: str) -> None:
    assert grpc_target(given, base) == target


@pytest.mark.parametrize("given", ["10.1.2.3:8001", "127.0.0.1", "127.0.0.1:8001/path", "127.0.0.1:http"])
def test_grpc_target_refuses_remote_or_malformed_addresses(given: str) -> None:
    with pytest.raises(LoadtestError, match="--grpc-url|not this machine"):
        grpc_target(given, "http://127.0.0.1:8000")


def test_template_caps_bodies_and_checks_rows() -> None:
    t = build_template(Protocol.PREDICT, "m", SIG, random_samples(SIG, 500), rows_per_request=1)
    assert len(t.bodies) == MAX_BODIES
    with pytest.raises(LoadtestError, match="rows-per-request"):
        build_template(Protocol.PREDICT, "m", SIG, random_samples(SIG, 5), rows_per_request=0)


def test_served_precision_from_responses() -> None:
    assert served_precision(Protocol.PREDICT, b'{"precision": "bf16", "outputs": []}', {}) == "bf16"
    v2 = b'{"model_name": "m", "parameters": {"precision": "fp32"}, "outputs": []}'
    assert served_precision(Protocol.V2_JSON, v2, {}) == "fp32"
    assert served_precision(Protocol.V2_BINARY, v2 + b"\x00\x01", {HEADER_LENGTH.lower(): str(len(v2))}) == "fp32"
    assert served_precision(Protocol.PREDICT, b"not json", {}) is None


def test_load_samples(tmp_path: Path) -> None:
    path = tmp_path / "x.json"
    path.write_text(json.dumps([[1, 2, 3], [4, 5, 6]]))
    np.testing.assert_array_equal(load_samples(path, SIG), [[1, 2, 3], [4, 5, 6]])
    path.write_text(json.dumps({"model": "m", "inputs": [[1, 2, 3]]}))
    assert load_samples(path, SIG).shape == (1, 3)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("[[1, 2]]", r"shape \[3\]"),
        ("[]", "non-empty"),
        ("{nope", "not a JSON file"),
        ("[[1, 2, 3], [4, 5]]", "one shape"),
    ],
)
def test_load_samples_errors_name_the_file(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(LoadtestError, match=message) as info:
        load_samples(path, SIG)
    assert str(path) in str(info.value)


def test_load_samples_missing_file(tmp_path: Path) -> None:
    with pytest.raises(LoadtestError, match="not found"):
        load_samples(tmp_path / "missing.json", SIG)


# Where load may go ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "base"),
    [
        ("http://127.0.0.1:8000", "http://127.0.0.1:8000"),
        ("http://localhost:8000/", "http://localhost:8000"),
        ("http://LOCALHOST", "http://localhost"),
        ("http://[::1]:8000", "http://[::1]:8000"),
        ("http://127.0.0.2:9000", "http://127.0.0.2:9000"),
    ],
)
def test_local_urls_are_accepted(url: str, base: str) -> None:
    assert check_url(url) == base


@pytest.mark.parametrize("url", ["http://example.com:8000", "http://10.0.0.5:8000", "https://192.168.1.2"])
def test_non_local_urls_are_refused(url: str) -> None:
    with pytest.raises(LoadtestError, match="--allow-remote"):
        check_url(url)
    assert check_url(url, allow_remote=True).startswith("http")


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("ftp://127.0.0.1", "http://HOST:PORT"),
        ("http://127.0.0.1:8000/predict", "without a path"),
        ("http://", "no host"),
    ],
)
def test_malformed_urls_are_refused(url: str, message: str) -> None:
    with pytest.raises(LoadtestError, match=message):
        check_url(url)


def test_is_local_host() -> None:
    assert is_local_host("localhost")
    assert is_local_host("127.0.0.1")
    assert is_local_host("::1")
    assert not is_local_host("0.0.0.0")
    assert not is_local_host("example.com")


def test_the_command_refuses_a_remote_url_before_sending_anything(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["loadtest", "--url", "http://203.0.113.7:8000", "--requests", "1"]) == 2
    err = capsys.readouterr().err
    assert "halfserve loadtest: error:" in err
    assert "not this machine" in err
    assert "--allow-remote" in err


# Options --------------------------------------------------------------------------------------------------------


def test_split_spreads_evenly() -> None:
    assert split(5, 2) == [3, 2]
    assert split(1, 3) == [1, 0, 0]
    assert split(8, 1) == [8]


def parse(*argv: str) -> LoadtestConfig:
    return config_from_args(build_parser().parse_args(["loadtest", *argv]))


def test_defaults() -> None:
    cfg = parse("--model", "tabular")
    assert cfg.concurrency == (1, 2, 4, 8, 16, 32, 64, 128)
    assert cfg.duration == 10.0
    assert cfg.requests is None
    assert cfg.protocol is Protocol.PREDICT
    assert cfg.rows_per_request == 1
    assert cfg.precisions == default_precisions(None)


def test_default_precisions_follow_the_device() -> None:
    assert default_precisions("cpu") == ("bf16", "fp32")


def test_options_parse() -> None:
    cfg = parse(
        "--model", "m", "--precisions", "fp16,fp32", "--concurrency", "1,4", "--requests", "50",
        "--protocol", "v2-binary", "--rows-per-request", "8", "--warmup", "0",
    )  # fmt: skip
    assert cfg.precisions == ("fp16", "fp32")
    assert cfg.concurrency == (1, 4)
    assert cfg.requests == 50
    assert cfg.duration is None
    assert cfg.protocol is Protocol.V2_BINARY
    assert cfg.rows_per_request == 8
    assert cfg.warmup == 0


@pytest.mark.parametrize(
    "argv",
    [
        ["--precisions", "fp8"],
        ["--concurrency", "0,2"],
        ["--concurrency", "a"],
        ["--duration", "1", "--requests", "5"],
        ["--protocol", "thrift"],
    ],
)
def test_bad_options_are_usage_errors(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["loadtest", "--model", "m", *argv])
    assert info.value.code == 2


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--url", "http://127.0.0.1:1", "--precisions", "bf16"], "--precisions"),
        (["--requests", "0"], "--requests"),
        (["--duration", "-1"], "--duration"),
        (["--rows-per-request", "0"], "--rows-per-request"),
        (["--precisions", "fp32,fp32"], "each precision once"),
    ],
)
def test_inconsistent_options_are_refused(argv: list[str], message: str) -> None:
    with pytest.raises(LoadtestError, match=message):
        parse("--model", "m", *argv)


def test_self_contained_needs_a_model() -> None:
    with pytest.raises(LoadtestError, match="--model is required"):
        parse()


def test_missing_optional_packages_are_named(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    assert cli_main(["loadtest", "--model", "tabular", "--requests", "1"]) == 2
    assert "needs matplotlib (pip install 'halfserve[train]')" in capsys.readouterr().err
