"""benchmarks/torchserve_bench.py end to end in its smoke mode (a tiny model, 2 s, c=4): the archive built with
torch-model-archiver, both imports, halfserve serving the JPEG and the UINT8 entries, the top-1 check and the table.

The full run takes ten minutes of a shared host and TorchServe's venv from the peers kit; this catches the script
breaking (an import flag, a store API it uses) without either. The numbers are not checked, only that every request
was answered and what a request carries on the wire. With the kit's TorchServe venv present, a second test runs
TorchServe beside it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.slow

SCRIPT = ROOT / "benchmarks" / "torchserve_bench.py"
TS_VENV = Path(os.environ.get("PEERS_WORK", "/work/peers-work")) / "venv" / "torchserve"
UINT8_IMAGE = 3 * 224 * 224


def smoke(out: Path, *extra: str) -> dict[str, dict[str, list[dict[str, float]]]]:
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--out", str(out), *extra],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    written = json.loads((out / "results.json").read_text())
    agreement = written["meta"]["models"]["smoke"]["agreement"]
    assert agreement["agreed"] == agreement["of"] == 2, agreement  # the tiny model's JPEG and UINT8 answers agree
    assert "| smoke | 4 | halfserve jpeg |" in (out / "results.md").read_text()
    results: dict[str, dict[str, list[dict[str, float]]]] = written["results"]
    return results


def test_the_smoke_run_serves_jpeg_and_uint8_bodies_from_the_archive(tmp_path: Path) -> None:
    pytest.importorskip("model_archiver", reason="torch-model-archiver is in the test extra")
    runs = smoke(tmp_path, "--no-torchserve")["smoke@4"]
    assert set(runs) == {"halfserve jpeg", "halfserve uint8"}
    jpeg, uint8 = runs["halfserve jpeg"][0], runs["halfserve uint8"][0]
    assert jpeg["requests"] > 0
    assert uint8["requests"] > 0
    assert 5_000 < jpeg["sent_b"] < UINT8_IMAGE  # a 320x240 JPEG, not its pixels
    assert uint8["sent_b"] > UINT8_IMAGE  # the cropped pixels, a JSON header and the HTTP head
    assert jpeg["cpu_ms"] > 0


@pytest.mark.skipif(not (TS_VENV / "bin" / "torchserve").exists(), reason=f"no TorchServe venv at {TS_VENV}")
def test_the_smoke_run_with_torchserve_answers_the_same_top_1(tmp_path: Path) -> None:
    pytest.importorskip("model_archiver", reason="torch-model-archiver is in the test extra")
    runs = smoke(tmp_path)["smoke@4"]
    assert runs["torchserve jpeg"][0]["requests"] > 0
