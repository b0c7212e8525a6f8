"""The status page builds HTML from /models: a manifest's text must not become markup (stored XSS), and the
manifest's evaluation block takes numbers, not markup."""

from __future__ import annotations

import json
import shutil
import subprocess
from importlib import resources

import pytest
from pydantic import ValidationError

from halfserve.manifest import Manifest, TensorSpec

PAGE = resources.files("halfserve.api.http").joinpath("static/status.html").read_text()
ATTACK = '<img src=x onerror="alert(1)">'

RENDER = r"""
const page = require("fs").readFileSync(0, "utf8");
const script = page.match(/<script>([\s\S]*)<\/script>/)[1];
globalThis.document = {getElementById: () => ({})};
globalThis.fetch = async () => { throw new Error("offline"); };
globalThis.setInterval = () => 0;
eval(script + "\nglobalThis.card = card;");
const model = JSON.parse(process.env.MODEL);
process.stdout.write(globalThis.card(model, 100));
"""


@pytest.mark.skipif(shutil.which("node") is None, reason="needs node to run the page's script")
def test_manifest_text_is_escaped_and_odd_types_do_not_break_the_card() -> None:
    model = {
        "name": ATTACK,
        "version": ATTACK,
        "state": "ready",
        "precision": ATTACK,
        "device": ATTACK,
        "batching": {"max_batch_size": ATTACK, "max_delay_ms": ATTACK},
        "evaluation": {"test_samples": ATTACK, "fp16_top1_agreement": ATTACK, "bf16_max_abs_logit_diff": "x"},
        "error": ATTACK,
        "stats": {
            "succeeded": ATTACK,
            "failed": 0,
            "rows": 1,
            "batches": 1,
            "queued_rows": ATTACK,
            "mean_batch_size": 1,
            "success_seconds": 1,
            "batch_size_histogram": {ATTACK: 1},
        },
    }
    out = subprocess.run(
        ["node", "-e", RENDER], input=PAGE, env={"MODEL": json.dumps(model)}, capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 0, out.stderr
    assert "<section" in out.stdout
    assert "<img" not in out.stdout
    assert "&lt;img" in out.stdout  # shown as text


def manifest(evaluation: object) -> Manifest:
    return Manifest.model_validate(
        {
            "name": "m",
            "architecture": "mlp",
            "arch_kwargs": {"in_features": 4, "hidden": [4], "out_features": 2},
            "inputs": [TensorSpec(name="x", shape=[4])],
            "outputs": [TensorSpec(name="y", shape=[2])],
            "evaluation": evaluation,
        }
    )


@pytest.mark.parametrize(
    "evaluation",
    [
        {"test_samples": ATTACK},
        {"test_samples": -1},
        {"fp16_accuracy": "0.9"},
        {"device": ATTACK},
        {ATTACK: 1.0},
        {"fp16_accuracy": True},
    ],
)
def test_an_evaluation_block_with_anything_but_metrics_is_refused(evaluation: dict[str, object]) -> None:
    with pytest.raises(ValidationError, match="evaluation"):
        manifest(evaluation)


def test_a_trained_evaluation_block_is_accepted() -> None:
    block = {"test_samples": 114, "device": "cuda:0", "fp16_accuracy": 0.96, "fp16_max_abs_logit_diff": None}
    assert manifest(block).evaluation == block
