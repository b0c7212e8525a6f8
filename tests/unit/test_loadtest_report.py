"""The load test's report: JSON, Markdown table and PNG from a sweep built by hand."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from rich.console import Console

from halfserve.loadtest import report
from halfserve.loadtest.config import LoadtestConfig
from halfserve.loadtest.payload import Signature
from halfserve.loadtest.runner import ServerRun, Sweep
from halfserve.loadtest.stats import LevelSample, ServerDelta, summarize

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def make_sweep(tmp_path: Path, precisions: tuple[str, ...]) -> Sweep:
    cfg = LoadtestConfig(model="m", precisions=precisions, concurrency=(1, 4), duration=None, requests=20, out=tmp_path)
    sweep = Sweep(cfg, model="m", signature=Signature("x", "FP32", (3,)), input_description="random")
    for i, precision in enumerate(precisions):
        sweep.servers.append(ServerRun(precision, precision, "http://127.0.0.1:1", "cpu", started=True))
        for c in cfg.concurrency:
            sample = LevelSample(np.linspace(0.001, 0.01, 20), elapsed_s=0.1 * (i + 1) / c, client_cpu_s=0.01)
            sweep.results.append(
                summarize(
                    sample,
                    precision=precision,
                    served_precision=precision,
                    protocol="predict",
                    concurrency=c,
                    rows_per_request=1,
                    server=ServerDelta(rows=20, batches=20 // c),
                )
            )
    sweep.client_ceiling = summarize(
        LevelSample(np.full(100, 0.001), elapsed_s=0.1, client_cpu_s=0.1),
        precision=precisions[0],
        served_precision=None,
        protocol="GET /health",
        concurrency=4,
        rows_per_request=0,
    )
    sweep.finish()
    return sweep


def test_write_json_table_and_plot(tmp_path: Path) -> None:
    sweep = make_sweep(tmp_path, ("bf16", "fp32"))
    paths = report.write(sweep, tmp_path / "out")
    data = json.loads(paths["json"].read_text())
    assert data["model"] == "m"
    assert data["requests_per_level"] == 20
    assert data["duration_s"] is None
    assert len(data["results"]) == 4
    assert data["throughput_ratio"] == {"bf16/fp32": {"1": 2.0, "4": 2.0}}
    assert [r["throughput_vs_fp32"] for r in data["results"]] == [2.0, 2.0, 1.0, 1.0]
    assert data["client_ceiling"]["req_per_s"] == 1000.0
    assert data["signature"] == {"name": "x", "datatype": "FP32", "shape": [3]}
    png = paths["plot"].read_bytes()
    assert png.startswith(PNG_MAGIC)
    assert len(png) > 10_000
    table = paths["table"].read_text()
    assert table.count("\n| bf16 |") == 2
    assert "bf16/fp32 throughput (rows/s): c=1 2.00x, c=4 2.00x" in table


def test_one_precision_has_no_ratio_panel(tmp_path: Path) -> None:
    sweep = make_sweep(tmp_path, ("fp32",))
    assert sweep.ratios == {}
    paths = report.write(sweep, tmp_path)
    assert paths["plot"].read_bytes().startswith(PNG_MAGIC)
    assert json.loads(paths["json"].read_text())["throughput_ratio"] == {}


def test_printed_summary(tmp_path: Path) -> None:
    console = Console(record=True, width=200)
    report.print_summary(make_sweep(tmp_path, ("bf16", "fp32")), console)
    text = console.export_text()
    assert "client ceiling: 1,000 req/s" in text
    assert "bf16/fp32 throughput" in text
    assert "2.00x" in text


def test_errors_are_listed_by_kind(tmp_path: Path) -> None:
    sweep = make_sweep(tmp_path, ("fp32",))
    failing = LevelSample(np.full(5, 0.01), {"503": 4}, {"ReadTimeout": 1}, elapsed_s=1.0)
    sweep.results.append(
        summarize(
            failing, precision="fp32", served_precision="fp32", protocol="predict", concurrency=8, rows_per_request=1
        )
    )
    assert "| 5 (503: 4, ReadTimeout: 1) |" in report.markdown(sweep)


def test_a_level_without_a_success_is_written_not_a_crash(tmp_path: Path) -> None:
    cfg = LoadtestConfig(model="m", url="http://127.0.0.1:1", concurrency=(1, 4), duration=1.0, out=tmp_path)
    sweep = Sweep(cfg, model="m", signature=Signature("x", "FP32", (3,)), input_description="random")
    for c, latencies in ((1, np.full(5, 0.002)), (4, np.empty(0))):
        sample = LevelSample(latencies, errors_by_status={"503": 7}, elapsed_s=1.0, client_cpu_s=0.1)
        sweep.results.append(
            summarize(
                sample,
                precision="fp32",
                served_precision="fp32",
                protocol="predict",
                concurrency=c,
                rows_per_request=1,
                server=ServerDelta(rows=5, batches=5),
            )
        )
    sweep.finish()
    paths = report.write(sweep, tmp_path / "out")
    assert paths["plot"].read_bytes().startswith(PNG_MAGIC)
    table = paths["table"].read_text()
    assert "| fp32 | 4 | 7 | 0 | - | - | - | - |" in table
    assert "! no successful request (no latency, see errors): fp32 c=4" in table
    assert json.loads(paths["json"].read_text())["results"][1]["p99_ms"] is None


def test_a_sweep_where_nothing_succeeded_still_plots(tmp_path: Path) -> None:
    cfg = LoadtestConfig(model="m", url="http://127.0.0.1:1", concurrency=(1,), duration=1.0, out=tmp_path)
    sweep = Sweep(cfg, model="m", signature=Signature("x", "FP32", (3,)), input_description="random")
    sample = LevelSample(np.empty(0), errors_by_exception={"RequestTimeout": 1}, elapsed_s=3.0, client_cpu_s=0.1)
    sweep.results.append(
        summarize(
            sample,
            precision="fp32",
            served_precision="fp32",
            protocol="predict",
            concurrency=1,
            rows_per_request=1,
            server=ServerDelta(rows=0, batches=0),
        )
    )
    sweep.finish()
    assert report.write(sweep, tmp_path / "out")["plot"].read_bytes().startswith(PNG_MAGIC)
