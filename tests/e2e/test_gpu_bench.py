"""benchmarks/gpu_bench.py end to end on the CPU, at a size that runs in seconds: the in-process ceiling, the instance
sweep and a real server swept by each load generator, as docs/gpu.md's CPU command runs it.

A GPU run costs minutes of a borrowed machine; this catches the script breaking (an argument, a helper it shares
with the other benchmarks) before one is spent on it. The numbers are not checked, only that every level served.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.slow

# ResNet-50 at 32x32 in fp32, one instance, two concurrency levels of a second each: about 17 s per run on 2 cores.
TINY = shlex.split(
    "--device cpu --image-size 32 --batch-sizes 1,2 --precisions fp32 --seconds 0.2 --instances 1 "
    "--instance-counts 1 --concurrency 1,2 --duration 1 --warmup 1 --client-processes 1 --wrk-threads 1"
)
# The Poisson sweep at a fixed first rate (so the seeded schedule, 20 requests in the measured 2 s, does not depend on
# this host's speed), two rates, within 15 s.
POISSON = shlex.split(
    "--poisson --poisson-start 10 --p99-limit-ms 2000 --poisson-seconds 2 --poisson-warmup 0.5 --poisson-steps 2 "
    "--poisson-budget 15"
)
WRK = os.environ.get("WRK", "wrk")  # what benchmarks/common.py runs


@pytest.mark.parametrize(
    ("generator", "wire", "serve_args"),
    [
        pytest.param("loadtest", "fp32", "--threads 2", id="loadtest"),
        pytest.param(
            "wrk",
            "uint8",
            "",
            id="wrk",
            marks=pytest.mark.skipif(shutil.which(WRK) is None, reason=f"{WRK} is not on PATH (apt-get install wrk)"),
        ),
    ],
)
def test_gpu_bench_runs_on_a_cpu(tmp_path: Path, generator: str, wire: str, serve_args: str) -> None:
    out = tmp_path / "out"
    cmd = [sys.executable, "benchmarks/gpu_bench.py", *TINY, "--load-generator", generator, "--wires", wire]
    if generator == "loadtest":
        cmd += POISSON
    cmd.append(f"--serve-args={serve_args}")
    run = subprocess.run([*cmd, "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]

    result = json.loads((out / "gpu_bench.json").read_text())
    assert {"ceiling_runs", "ceiling", "instances", "weight_bytes", "servers", "seconds"} <= result.keys()
    assert result["device"] == "cpu"
    assert result["ceiling"]["fp32"]["best_engine_rows_per_s"].keys() == {"1", "2"}
    assert result["instances"]["rows_per_s"]["1"] > 0
    assert list(result["servers"]) == [wire]
    server = result["servers"][wire]
    assert server["wire"] == wire
    assert server["server_args"] == serve_args.split()
    assert server["loadtest"].get("load_generator", "").startswith("wrk") is (generator == "wrk")
    levels = server["summary"]["levels"]
    assert [(r["precision"], r["concurrency"]) for r in levels] == [("fp32", 1), ("fp32", 2)]
    for r in levels:
        assert r["rows_per_s"] > 0, r
        assert r["errors"] == 0, r
        assert r["server_over_ceiling"] > 0, r
        # The ceilings that match the question: the in-process closed loop of as many clients, and the forward at
        # the batch that many requests allow.
        for key in ("server_over_closed_loop", "server_over_forward", "closed_loop_p99_ms", "p99_ms"):
            assert 0 < r[key] < math.inf, (key, r)  # NaN fails too
        assert r["forward_batch"] == r["concurrency"], r  # one instance, batch sizes 1 and 2 measured
    assert result["closed_loop"][wire]["fp32"].keys() == {"1", "2"}
    table = (out / "gpu_bench.md").read_text()
    assert "| server / closed loop | forward batch | server / forward |" in table
    assert table.startswith("# GPU fast path")
    if generator == "loadtest":
        # Open-loop Poisson arrivals: every rate measured and answered; which rates pass is this host's business.
        run = result["poisson"]["halfserve"]
        assert run["precision"] == "fp32"
        assert run["limit_ms"] == 2000
        assert [t["rate"] for t in run["trials"]][:1] == [10]
        assert len(run["trials"]) == 2
        for t in run["trials"]:
            assert t["requests"] > 0, t
            assert t["errors"] == 0, t
            assert 0 < t["p99_ms"] < math.inf, t
        assert run["best_rate"] in (None, *[t["rate"] for t in run["trials"]])
        assert "## Poisson arrivals, halfserve: highest rate with p99 <= 2000 ms" in table
    assert (out / "gpu_bench.png").stat().st_size > 0


# An interpreter with nvidia-pytriton (and torch, safetensors, pydantic importable): docs/gpu.md's "PyTriton beside
# halfserve" builds one. Where none is given, the peer's smoke test is skipped.
PYTRITON = os.environ.get("PYTRITON_PYTHON", "")


@pytest.mark.skipif(not Path(PYTRITON).is_file(), reason="PYTRITON_PYTHON names no interpreter with nvidia-pytriton")
def test_gpu_bench_runs_pytriton_beside_halfserve_on_a_cpu(tmp_path: Path) -> None:
    out = tmp_path / "out"
    generator = "wrk" if shutil.which(WRK) else "loadtest"  # the peer's levels need wrk; the Poisson sweep does not
    cmd = [sys.executable, "benchmarks/gpu_bench.py", *TINY, *POISSON, "--poisson-steps", "1"]
    cmd += ["--load-generator", generator, "--peer", "pytriton", "--pytriton-python", PYTRITON, "--out", str(out)]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]

    result = json.loads((out / "gpu_bench.json").read_text())
    peer = result["peers"]["pytriton"]
    assert peer["precision"] == "fp32"
    assert peer["beside"] == "fp32"
    # The same weights, normalisation and precision: the peer answers what halfserve's Engine does.
    assert peer["answer_argmax_agrees"] is True
    assert peer["answer_max_abs_diff_from_halfserve"] < 1e-3
    assert [r["concurrency"] for r in peer["levels"]] == ([1, 2] if generator == "wrk" else [])
    for r in peer["levels"]:
        assert r["rows_per_s"] > 0, r
        assert r["errors"] == 0, r
    # Both servers on the same Poisson schedule.
    ours, theirs = result["poisson"]["halfserve"], result["poisson"]["pytriton"]
    assert [t["rate"] for t in theirs["trials"]] == [t["rate"] for t in ours["trials"]] == [10]
    assert theirs["trials"][0]["requests"] == ours["trials"][0]["requests"] > 0
    assert theirs["trials"][0]["errors"] == 0
    table = (out / "gpu_bench.md").read_text()
    assert "## Peer pytriton, fp32" in table
    assert "## Poisson arrivals, pytriton" in table
