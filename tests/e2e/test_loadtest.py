"""``halfserve loadtest`` for real: it starts its own servers, and it loads one already running."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from halfserve.loadtest.cli import main as loadtest_main
from tests.conftest import ROOT, SHIPPED_STORE, ServerProcess, free_port

MODEL = "tabular"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
pytestmark = pytest.mark.slow

StartServer = Callable[..., ServerProcess]


def check_report(out: Path, precisions: list[str], concurrency: list[int], requests: int, rows: int) -> dict[str, Any]:
    """The files exist and every row's numbers are consistent."""
    data: dict[str, Any] = json.loads((out / "loadtest.json").read_text())
    png = (out / "loadtest.png").read_bytes()
    assert png.startswith(PNG_MAGIC)
    assert len(png) > 20_000
    assert (out / "loadtest.md").read_text().startswith("| precision |")
    results = data["results"]
    assert [(r["precision"], r["concurrency"]) for r in results] == [(p, c) for p in precisions for c in concurrency]
    for r in results:
        assert r["requests"] == requests
        assert r["requests"] == r["successes"] + r["errors"]
        assert r["errors"] == 0, (r["errors_by_status"], r["errors_by_exception"])
        assert r["rows"] == r["requests"] * rows
        assert r["rows_per_request"] == rows
        assert 0 < r["p50_ms"] <= r["p90_ms"] <= r["p99_ms"] <= r["max_ms"]
        assert r["req_per_s"] > 0
        assert r["mean_batch_size"] >= 1
        # Every row this level sent reached the batcher (nothing else loads this server).
        assert r["server_rows"] == r["rows"]
    assert "throughput_ratio" in data
    return data


def test_self_contained_sweep_over_two_precisions(tmp_path: Path) -> None:
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "halfserve", "loadtest", "--store", str(SHIPPED_STORE), "--model", MODEL]
    cmd += ["--precisions", "bf16,fp32", "--concurrency", "1,4", "--requests", "50", "--warmup", "0.2"]
    cmd += ["--client-ceiling", "0.5", "--out", str(out), "--no-progress"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    data = check_report(out, ["bf16", "fp32"], [1, 4], requests=50, rows=1)
    assert data["mode"] == "self-contained"
    assert set(data["throughput_ratio"]) == {"bf16/fp32"}
    assert set(data["throughput_ratio"]["bf16/fp32"]) == {"1", "4"}
    assert [r["served_precision"] for r in data["results"]] == ["bf16", "bf16", "fp32", "fp32"]
    assert data["client_ceiling"]["req_per_s"] > 0
    assert [s["precision"] for s in data["servers"]] == ["bf16", "fp32"]
    assert all(s["started"] for s in data["servers"])
    # The servers it started were stopped: SIGTERM drained them and they logged their shutdown.
    assert "bf16/fp32 throughput (rows/s)" in proc.stdout
    assert (out / "server-bf16.log").is_file()
    assert (out / "server-fp32.log").is_file()


def test_self_contained_sweep_over_grpc(tmp_path: Path) -> None:
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "halfserve", "loadtest", "--store", str(SHIPPED_STORE), "--model", MODEL]
    cmd += ["--precisions", "fp32", "--concurrency", "2", "--requests", "30", "--warmup", "0", "--protocol", "grpc"]
    cmd += ["--client-ceiling", "0", "--out", str(out), "--no-progress"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    data = check_report(out, ["fp32"], [2], requests=30, rows=1)
    assert data["protocol"] == "grpc"
    assert data["results"][0]["served_precision"] == "fp32"
    assert "--grpc-port" in data["servers"][0]["command"]


@pytest.fixture(scope="module")
def grpc_port() -> int:
    """Picked as the server that binds it starts: picked as the module was collected, it stayed free, unheld, for
    however long the tests before this module ran, and anything binding a port meanwhile could take it."""
    return free_port()


@pytest.fixture(scope="module")
def running_server(server_factory: StartServer, grpc_port: int) -> ServerProcess:
    grpc = ("--grpc", "--grpc-port", str(grpc_port))
    return server_factory(SHIPPED_STORE, "--models", MODEL, "--precision", "fp32", *grpc)


@pytest.mark.parametrize("protocol", ["predict", "v2-json", "v2-binary", "grpc"])
def test_against_a_running_server(running_server: ServerProcess, grpc_port: int, tmp_path: Path, protocol: str) -> None:
    url = running_server.url.replace("127.0.0.1", "localhost")
    argv = ["--url", url, "--concurrency", "2,8", "--requests", "40", "--rows-per-request", "3"]
    argv += ["--protocol", protocol, "--warmup", "0", "--client-ceiling", "0", "--out", str(tmp_path), "--no-progress"]
    if protocol == "grpc":
        argv += ["--grpc-url", f"localhost:{grpc_port}"]
    assert loadtest_main(argv) == 0
    data = check_report(tmp_path, ["fp32"], [2, 8], requests=40, rows=3)
    assert data["mode"] == "url"
    assert data["model"] == MODEL  # the only model served
    assert data["protocol"] == protocol
    assert data["throughput_ratio"] == {}
    assert data["client_ceiling"] is None
    assert data["servers"][0]["started"] is False
    assert data["results"][0]["served_precision"] == "fp32"


def test_input_file_two_client_processes_and_a_clear_error_for_a_wrong_input(
    running_server: ServerProcess, tmp_path: Path
) -> None:
    good = tmp_path / "good.json"
    good.write_text(json.dumps([[float(i)] * 30 for i in range(5)]))
    argv = ["--url", running_server.url, "--concurrency", "3", "--requests", "10", "--warmup", "0"]
    argv += ["--client-ceiling", "0", "--no-progress", "--out", str(tmp_path / "out"), "--client-processes", "2"]
    assert loadtest_main([*argv, "--input", str(good)]) == 0
    data = check_report(tmp_path / "out", ["fp32"], [3], requests=10, rows=1)
    assert data["input"] == f"5 samples from {good}"
    assert data["machine"]["client_processes"] == 2
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([[1.0, 2.0]]))
    assert loadtest_main([*argv, "--input", str(bad)]) == 2
