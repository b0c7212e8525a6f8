"""A request a model cannot take is answered with a 400 naming the field and what would be right: text sent to a
model that takes numbers, an input name the model does not have in a ``/predict`` mapping, and no ``model`` when
several are served (the request's fault, not a model missing)."""

from __future__ import annotations

from pathlib import Path

from halfserve.settings import Settings
from tests.conftest import save_tiny_mlp
from tests.integration.conftest import serving


async def test_text_for_a_model_that_takes_numbers_names_the_input_and_its_datatype(tmp_path: Path) -> None:
    save_tiny_mlp(tmp_path)
    async with serving(Settings(store=tmp_path, precision="fp32")) as client:
        body = {"inputs": [{"name": "features", "datatype": "BYTES", "shape": [1], "data": ["a text"]}]}
        r = await client.post("/v2/models/tiny/infer", json=body)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error.startswith("inputs[0].datatype: input 'features' of model 'tiny' takes FP32, not BYTES")
        assert "unknown datatype" not in error


async def test_a_wrong_input_name_in_a_predict_mapping_is_named(tmp_path: Path) -> None:
    save_tiny_mlp(tmp_path)
    async with serving(Settings(store=tmp_path, precision="fp32")) as client:
        r = await client.post("/predict", json={"inputs": {"feature": [[0.0] * 16]}})
        assert r.status_code == 400, r.text
        assert r.json()["error"] == "inputs.feature: unexpected input; the model takes ['features']"
        right = await client.post("/predict", json={"inputs": {"features": [[0.0] * 16]}})
        assert right.status_code == 200, right.text


async def test_no_model_named_when_several_are_served_is_a_400(tmp_path: Path) -> None:
    save_tiny_mlp(tmp_path)
    save_tiny_mlp(tmp_path, "other")
    async with serving(Settings(store=tmp_path, precision="fp32")) as client:
        r = await client.post("/predict", json={"inputs": [[0.0] * 16]})
        assert r.status_code == 400, r.text
        assert r.json()["error"] == 'model: several models are served (other, tiny); name one with "model"'
        named = await client.post("/predict", json={"model": "tiny", "inputs": [[0.0] * 16]})
        assert named.status_code == 200, named.text
