"""Train ``digits_cnn`` into a fresh store, then serve that store in-process: what training wrote is what serves."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from halfserve import store
from halfserve.settings import Settings
from halfserve.training import TrainResult, train
from halfserve.training.datasets import digits_8x8
from tests.integration.conftest import serving


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> TrainResult:
    return train("digits_cnn", tmp_path_factory.mktemp("store"), max_steps=20, device="cpu", precision="bf16")


@pytest.fixture(scope="module")
def samples() -> np.ndarray:
    return digits_8x8().x_test[:12].numpy()


def in_process_fp32(store_dir: Path, x: np.ndarray) -> np.ndarray:
    loaded = store.load(store_dir, "digits_cnn")
    with torch.inference_mode():
        return loaded.module(torch.from_numpy(x)).numpy()


async def test_served_fp32_outputs_match_the_checkpoint(trained: TrainResult, samples: np.ndarray) -> None:
    store_dir = trained.version_dir.parent.parent
    async with serving(Settings(store=store_dir, precision="fp32")) as client:
        r = await client.post("/predict", json={"model": "digits_cnn", "inputs": samples.tolist()})
    assert r.status_code == 200, r.text
    body = r.json()
    assert (body["model"], body["version"], body["precision"]) == ("digits_cnn", trained.version, "fp32")
    outputs = np.asarray(body["outputs"], dtype=np.float32)
    assert outputs.shape == (12, 10)
    want = in_process_fp32(store_dir, samples)
    np.testing.assert_allclose(outputs, want, rtol=1e-5, atol=1e-5)
    assert body["labels"] == [str(i) for i in want.argmax(axis=1)]


async def test_served_half_precision_agrees_with_the_training_evaluation(
    trained: TrainResult, samples: np.ndarray
) -> None:
    """Served as the manifest says (``auto``: a half precision on a CPU with bf16 units, else fp32)."""
    store_dir = trained.version_dir.parent.parent
    async with serving(Settings(store=store_dir)) as client:
        r = await client.post("/predict", json={"model": "digits_cnn", "inputs": samples.tolist()})
    assert r.status_code == 200, r.text
    body = r.json()
    outputs = np.asarray(body["outputs"], dtype=np.float32)
    reference = in_process_fp32(store_dir, samples)
    diff = trained.manifest.evaluation or {}
    # The evaluation measured the largest logit error of this checkpoint in each half precision on the test split.
    bound = {"fp32": 1e-5, "bf16": diff.get("bf16_max_abs_logit_diff"), "fp16": diff.get("fp16_max_abs_logit_diff")}
    assert body["precision"] in bound, body["precision"]
    # Kernels may differ with the batch size, hence the margin.
    assert np.abs(outputs - reference).max() <= 1.5 * float(bound[body["precision"]]) + 1e-3
