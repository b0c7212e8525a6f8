"""Fidelity at load: calibration samples stored with a version (else random ones) run in fp32 and in the half precision
before the model serves; the figures show in /models, and a model below its bar (its manifest's min_agreement, the
older spelling, or the default bar) is served in fp32 instead."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import save_file

from halfserve import fidelity, models, storage, store
from halfserve.execution import Batching, Execution
from halfserve.fidelity import CALIBRATION
from halfserve.manifest import Manifest, TensorSpec, load_manifest
from halfserve.settings import Settings
from tests.conftest import save_half_fails, save_tiny_mlp
from tests.integration.conftest import serving
from tests.integration.test_padding_invariance import listed, started


def save_linear(root: Path, bias: float, min_agreement: float | None, samples: np.ndarray | None) -> Path:
    """Linear(4 -> 2) with equal weight rows and output 1 ahead by ``bias``: for inputs near 100 both outputs are
    near 400, where bf16's step is 2, so a small ``bias`` is lost in bf16 (a tie, argmax 0) and kept in fp32."""
    kwargs = {"in_features": 4, "hidden": [], "out_features": 2}
    module = models.build("mlp", **kwargs)
    with torch.no_grad():
        module.net[0].weight.fill_(1.0)
        module.net[0].bias.copy_(torch.tensor([0.0, bias]))
    manifest = Manifest(
        name="lin",
        architecture="mlp",
        arch_kwargs=kwargs,
        inputs=[TensorSpec(name="x", shape=[4])],
        outputs=[TensorSpec(name="y", shape=[2])],
        precision="bf16",
        min_agreement=min_agreement,
        batching=Batching(max_batch_size=16),
    )
    vdir = store.save(root, manifest, module)
    if samples is not None:
        save_file({"x": samples}, str(vdir / CALIBRATION))
    return root


def near_100(rows: int) -> np.ndarray:
    return np.random.default_rng(0).uniform(99.0, 101.0, (rows, 4)).astype(np.float32)


async def listing(client: object) -> dict[str, object]:
    body = (await client.get("/models")).json()  # type: ignore[attr-defined]
    return body["models"][0] if isinstance(body, dict) else body[0]


async def test_agreement_is_measured_at_load_and_reported(tmp_path: Path) -> None:
    async with serving(Settings(store=save_linear(tmp_path, 50.0, 0.99, near_100(40)))) as client:
        entry = await listing(client)
        f = entry["fidelity"]
        assert f["samples"] == 40
        assert f["precision"] == "bf16"
        assert f["top1_agreement"] == 1.0  # a bias of 50 survives bf16's rounding
        assert 0 < f["max_abs_error"] <= 4.0  # bf16 rounds values near 400 to steps of 2
        assert f["max_rel_error"] is None  # class scores are held to their top-1 agreement
        assert f["min_cosine"] > 0.999  # and, without labels, to their direction
        assert f["source"] == "calibration"
        assert entry["precision"] == "bf16"
        assert entry["fp32_fallback"] is None
        assert entry["fidelity_shortfall"] is None
        assert entry["precision_source"] == "manifest"
        metrics = (await client.get("/metrics")).text
        assert 'halfserve_model_fp32_fallback{model="lin",version="1"} 0.0' in metrics


async def test_a_model_below_its_min_agreement_is_served_in_fp32_with_the_reason(tmp_path: Path) -> None:
    async with serving(Settings(store=save_linear(tmp_path, 0.001, 0.99, near_100(40)))) as client:
        entry = await listing(client)
        assert entry["fidelity"]["top1_agreement"] < 0.5  # bf16 ties most rows (argmax 0); fp32 picks output 1
        assert entry["precision"] == "fp32"
        assert "below the manifest's min_agreement 0.99" in entry["fp32_fallback"]
        metrics = (await client.get("/metrics")).text
        assert 'halfserve_model_fp32_fallback{model="lin",version="1"} 1.0' in metrics
        r = await client.post("/predict", json={"inputs": near_100(2).tolist()})
        assert r.json()["precision"] == "fp32"
        assert r.json()["outputs"][0][1] > r.json()["outputs"][0][0]


async def test_without_min_agreement_a_disagreeing_model_is_held_to_the_default_bar(tmp_path: Path) -> None:
    async with serving(Settings(store=save_linear(tmp_path, 0.001, None, near_100(8)))) as client:
        entry = await listing(client)
        assert entry["fidelity"]["top1_agreement"] < 0.5
        assert entry["precision"] == "fp32"
        assert "below the default min_top1_agreement 0.98" in entry["fp32_fallback"]


async def test_without_calibration_samples_random_ones_are_measured_and_named(tmp_path: Path) -> None:
    async with serving(Settings(store=save_linear(tmp_path, 0.001, 0.99, None))) as client:
        entry = await listing(client)
        assert entry["fidelity"]["source"] == "random"
        assert entry["fidelity"]["samples"] == 64
        # Random normal inputs give outputs near 0 where bf16 still cannot keep 0.001 apart.
        assert entry["fidelity"]["top1_agreement"] < 0.5
        assert entry["precision"] == "fp32"
        assert "on 64 random samples, below the manifest's min_agreement 0.99" in entry["fp32_fallback"]


async def test_a_model_that_meets_the_default_bar_keeps_its_half_precision(tmp_path: Path) -> None:
    async with serving(Settings(store=save_linear(tmp_path, 50.0, None, None))) as client:
        entry = await listing(client)
        assert entry["fidelity"]["top1_agreement"] == 1.0
        assert entry["precision"] == "bf16"


def test_samples_that_do_not_fit_fail_the_load_naming_the_file(tmp_path: Path) -> None:
    from halfserve.fidelity import read_samples

    save_linear(tmp_path, 1.0, None, None)
    vdir = tmp_path / "lin" / "1"
    manifest = load_manifest(tmp_path / "lin")
    save_file({"pixels": near_100(2)}, str(vdir / CALIBRATION))
    with pytest.raises(storage.StoreError, match=r"calibration.safetensors: holds \['pixels'\]"):
        read_samples(vdir, manifest)
    save_file({"x": np.zeros((2, 5), np.float32)}, str(vdir / CALIBRATION))
    with pytest.raises(storage.StoreError, match=r"'x' has samples of shape \[5\], not \[4\]"):
        read_samples(vdir, manifest)
    (vdir / CALIBRATION).write_bytes(b"\xff" * 64)
    with pytest.raises(storage.StoreError, match="cannot read calibration samples"):
        read_samples(vdir, manifest)


def test_min_agreement_needs_an_output_to_rank() -> None:
    with pytest.raises(ValueError, match="min_agreement needs a floating output"):
        Manifest(
            name="m",
            architecture="mlp",
            inputs=[TensorSpec(name="x", shape=[4])],
            outputs=[TensorSpec(name="y", shape=[1])],
            min_agreement=0.9,
        )


def test_min_agreement_and_its_newer_name_are_one_bar() -> None:
    fields = {
        "name": "m",
        "architecture": "mlp",
        "inputs": [{"name": "x", "shape": [4]}],
        "outputs": [{"name": "y", "shape": [2]}],
    }
    with pytest.raises(ValueError, match="min_agreement and fidelity.min_top1_agreement: give one"):
        Manifest.model_validate({**fields, "min_agreement": 0.9, "fidelity": {"min_top1_agreement": 0.8}})
    legacy = fidelity.bar(Manifest.model_validate({**fields, "min_agreement": 0.9, "fidelity": {"min_cosine": 0.5}}))
    assert (legacy.min_top1_agreement, legacy.min_cosine, legacy.max_rel_error) == (0.9, 0.5, 0.02)
    assert legacy.origin("min_top1_agreement") == "the manifest's min_agreement"
    assert legacy.origin("max_rel_error") == "the default max_rel_error"


def test_the_fp32_reference_is_eager_whatever_the_manifest_s_execution(tmp_path: Path) -> None:
    save_tiny_mlp(tmp_path, execution=Execution(compile="inductor"), batching=Batching(max_batch_size=2))
    loaded = store.load(tmp_path, "tiny")
    reference = fidelity.fp32_reference(loaded)
    try:
        assert loaded.manifest.execution.compile.value == "inductor"
        assert reference.inductor is False  # not compiled at every load for a few rows, nor cached
        x = np.random.default_rng(0).standard_normal((2, 16)).astype(np.float32)
        with torch.no_grad():
            want = loaded.module(torch.from_numpy(x)).numpy()
        np.testing.assert_allclose(reference.compute(x), want, rtol=1e-5, atol=1e-6)
    finally:
        reference.close()


async def test_a_model_whose_fp32_answers_are_all_not_finite_fails_to_load_naming_why(tmp_path: Path) -> None:
    """Finite weights that overflow fp32 for every input (a diverged run): every answer would be null, so the load
    fails rather than serve them, and the other models serve."""
    kwargs = {"in_features": 6, "hidden": [8], "out_features": 4}
    module = models.build("mlp", **kwargs)
    with torch.no_grad():
        module.net[0].weight.copy_(torch.tensor([[1e30], [-1e30]]).repeat(4, 6))  # one row of each pair passes the ReLU
        module.net[-1].weight.fill_(1e30)
    manifest = Manifest(
        name="diverged",
        architecture="mlp",
        arch_kwargs=kwargs,
        inputs=[TensorSpec(name="x", shape=[6])],
        outputs=[TensorSpec(name="y", shape=[4])],
        precision="bf16",
    )
    vdir = store.save(tmp_path, manifest, module)
    save_linear(tmp_path, 50.0, None, None)
    async with started(Settings(store=tmp_path)) as client:
        models_ = await listed(client)
        assert (await client.post("/predict", json={"model": "lin", "inputs": [[1.0] * 4]})).status_code == 200
    assert models_["lin"]["state"] == "ready"
    assert models_["diverged"]["state"] == "failed"
    assert str(models_["diverged"]["error"]).startswith(
        f"{vdir / storage.WEIGHTS}: in fp32 the model answers NaN or nothing finite for every one of the 64 random "
        "samples, so every answer would be NaN"
    )


TORCH_SAYS = "mat1 and mat2 must have the same dtype"
"""Torch's words for the half-precision forward's failure, which every reason carries."""


@pytest.mark.parametrize("warmup", [True, False], ids=["its-warm-up-raises", "its-measurement-raises"])
async def test_a_model_whose_half_forward_raises_is_served_in_fp32_with_the_reason(
    tmp_path: Path, half_fails_code: Path, warmup: bool
) -> None:
    models.add_code_path([half_fails_code])
    root = tmp_path / "store"
    save_half_fails(root)
    body = {"model": "halffails", "inputs": {"ids": [[1, 2, 3, 4, 5, 6]], "keep": [[True] * 6]}}
    async with serving(Settings(store=root, code_path=[half_fails_code], warmup=warmup)) as client:
        entry = await listing(client)
        assert (await client.post("/predict", json=body)).status_code == 200
    assert entry["precision"] == "fp32"
    assert entry["precision_source"] == "fidelity_fallback"
    reason = str(entry["fp32_fallback"])
    assert reason.startswith("bf16 forward fails where fp32's does not: "), reason
    assert TORCH_SAYS in reason  # an instance process (the placement CI also runs) reports it as its engine's error
    assert entry["fidelity_shortfall"] == entry["fp32_fallback"]


async def test_a_model_whose_half_forward_raises_unmeasured_fails_to_load_naming_why(
    tmp_path: Path, half_fails_code: Path
) -> None:
    """Its fidelity check off, the operator asked for bf16 unmeasured: there is nothing else to serve."""
    models.add_code_path([half_fails_code])
    root = tmp_path / "store"
    save_half_fails(root, fidelity={"check": False})
    save_tiny_mlp(root)
    async with started(Settings(store=root, code_path=[half_fails_code])) as client:
        models_ = await listed(client)
    assert models_["tiny"]["state"] == "ready"
    assert models_["halffails"]["state"] == "failed"
    error = str(models_["halffails"]["error"])
    assert error.startswith("bf16 forward fails where fp32's does not: RuntimeError: ")
    assert "the fidelity check is off for it, so it is served in bf16 or not at all" in error


async def test_a_switch_to_a_precision_whose_forward_raises_is_refused_naming_it(
    tmp_path: Path, half_fails_code: Path
) -> None:
    """The operator's explicit choice is not a fidelity failure: the switch fails (its warm-up runs the forward) and
    fp32 serves on."""
    models.add_code_path([half_fails_code])
    root = tmp_path / "store"
    save_half_fails(root)
    body = {"model": "halffails", "inputs": {"ids": [[1, 2, 3, 4, 5, 6]], "keep": [[True] * 6]}}
    token = "half-fails-admin-token"
    auth = {"Authorization": f"Bearer {token}"}
    async with serving(Settings(store=root, code_path=[half_fails_code], admin_token=token)) as client:
        r = await client.post("/models/halffails/precision", json={"precision": "bf16"}, headers=auth)
        assert r.status_code == 400
        error = r.json()["error"]
        assert error.startswith("failed to load 'halffails' in bf16: "), error
        assert TORCH_SAYS in error
        assert error.endswith("; it goes on serving in fp32")
        assert (await client.post("/predict", json=body)).status_code == 200
        assert (await listing(client))["precision"] == "fp32"
