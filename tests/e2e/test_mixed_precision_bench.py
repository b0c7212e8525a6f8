"""benchmarks/mixed_precision.py end to end at a size that runs in seconds: the import of its fragile classifier, the
plan's search under the store's own fidelity rules, the three engines and the table.

The script asserts that a plan exists, so a change to those rules that leaves its model without one breaks it; this
catches that here rather than at the documented command. The rates are not checked, only the plan and the agreement
the benchmark is there to show.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.slow

SCRIPT = ROOT / "benchmarks" / "mixed_precision.py"


def test_the_fragile_classifier_gets_a_plan_that_keeps_its_last_projection(tmp_path: Path) -> None:
    out = tmp_path / "out"
    cmd = [sys.executable, str(SCRIPT), "--seconds", "0.01", "--rounds", "1", "--batch-sizes", "1,4", "--out", str(out)]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]

    result = json.loads((out / "mixed.json").read_text())
    plan = result["plan"]["plan"]["fp32_modules"]
    assert "net.6" in plan, plan  # the fragile projection
    assert len(plan) < result["plan"]["plan"]["candidates"], plan  # not the whole model
    agreement = result["top1_agreement_with_fp32"]
    assert agreement["mixed"] >= 0.98, agreement
    assert agreement[result["half"]] < 0.98, agreement  # whole-model half precision misses the bar
    assert set(result["best_rows_per_s"]) == {"fp32", result["half"], "mixed"}
    assert "| mixed |" in (out / "mixed.md").read_text()
