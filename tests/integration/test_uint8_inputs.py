"""UINT8 inputs normalised by the server: the same answers as an fp32 model fed the client-side normalisation."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError

from halfserve.manifest import Manifest, Normalize, TensorSpec
from halfserve.settings import Settings
from tests.conftest import save_tiny_mlp
from tests.integration.conftest import serving

rng = np.random.default_rng(0)
MEAN = rng.uniform(0.2, 0.6, 16).round(3).tolist()
STD = rng.uniform(0.1, 0.4, 16).round(3).tolist()
PIXELS = rng.integers(0, 256, size=(4, 16))


@pytest.fixture
def store_dir(tmp_path: Path) -> Path:
    # One set of weights (seed 0) behind two signatures: bytes normalised by the server, and plain fp32.
    save_tiny_mlp(
        tmp_path,
        "bytes",
        inputs=[TensorSpec(name="pixels", datatype="UINT8", shape=[16])],
        normalize=Normalize(scale=1 / 255, mean=MEAN, std=STD),
    )
    save_tiny_mlp(tmp_path, "floats")
    return tmp_path


def client_side(pixels: np.ndarray) -> list[list[float]]:
    return ((pixels / 255 - np.array(MEAN)) / np.array(STD)).tolist()  # type: ignore[no-any-return]


async def test_uint8_over_json_and_binary_answer_as_the_normalised_fp32_model(store_dir: Path) -> None:
    raw = PIXELS.astype(np.uint8).tobytes()
    tensor = {"name": "pixels", "shape": [4, 16], "datatype": "UINT8", "parameters": {"binary_data_size": len(raw)}}
    header = json.dumps({"inputs": [tensor]}).encode()
    async with serving(Settings(store=store_dir, precision="fp32")) as client:
        want = (await client.post("/predict", json={"model": "floats", "inputs": client_side(PIXELS)})).json()
        by_json = (await client.post("/predict", json={"model": "bytes", "inputs": PIXELS.tolist()})).json()
        by_binary = await client.post(
            "/v2/models/bytes/infer",
            content=header + raw,
            headers={"Inference-Header-Content-Length": str(len(header)), "content-type": "application/octet-stream"},
        )
        listing = (await client.get("/models")).json()
    assert by_binary.status_code == 200, by_binary.text
    np.testing.assert_allclose(by_json["outputs"], want["outputs"], rtol=1e-5, atol=1e-5)
    v2_out = np.array(by_binary.json()["outputs"][0]["data"]).reshape(4, -1)
    np.testing.assert_allclose(v2_out, want["outputs"], rtol=1e-5, atol=1e-5)
    (entry,) = [m for m in listing["models"] if m["name"] == "bytes"]
    assert entry["inputs"][0]["datatype"] == "UINT8"


async def test_half_precision_normalises_in_fp32_then_casts(store_dir: Path) -> None:
    async with serving(Settings(store=store_dir, precision="bf16")) as client:
        half = (await client.post("/predict", json={"model": "bytes", "inputs": PIXELS.tolist()})).json()
    async with serving(Settings(store=store_dir, precision="fp32")) as client:
        full = (await client.post("/predict", json={"model": "floats", "inputs": client_side(PIXELS)})).json()
    assert half["precision"] == "bf16"
    out, ref = np.array(half["outputs"]), np.array(full["outputs"])
    np.testing.assert_allclose(out, ref, atol=0.03 * np.abs(ref).max(), rtol=0)


@pytest.mark.parametrize(
    ("value", "problem"), [(256, "do not fit uint8"), (-1, "do not fit uint8"), (1.5, "takes integers")]
)
async def test_values_a_byte_cannot_hold_are_refused(store_dir: Path, value: float, problem: str) -> None:
    sample = [0] * 15 + [value]
    async with serving(Settings(store=store_dir, precision="fp32")) as client:
        bad = await client.post("/predict", json={"model": "bytes", "inputs": [sample]})
        good = await client.post("/predict", json={"model": "bytes", "inputs": [[0] * 16]})
    assert bad.status_code == 400
    assert bad.json()["error"].startswith("inputs")
    assert problem in bad.json()["error"]
    assert good.status_code == 200


def test_normalisation_needs_one_mean_and_std_per_channel() -> None:
    fields = {
        "name": "m",
        "architecture": "mlp",
        "inputs": [{"name": "x", "datatype": "UINT8", "shape": [3, 8, 8]}],
        "outputs": [{"name": "y", "shape": [2]}],
    }
    Manifest.model_validate({**fields, "normalize": {"scale": 0.5, "mean": [0, 0, 0], "std": [1, 1, 1]}})
    with pytest.raises(ValidationError, match=r"normalize\.mean has 2 values but the input has 3 channels"):
        Manifest.model_validate({**fields, "normalize": {"mean": [0, 0]}})
    with pytest.raises(ValidationError, match="std must be positive"):
        Manifest.model_validate({**fields, "normalize": {"std": [1, 0, 1]}})
