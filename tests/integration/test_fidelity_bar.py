"""The default fidelity bar: a model imported with ``halfserve import`` and served in a half precision with no flag at
all is compared with fp32 at load, and served in fp32 (reason in /models, a WARNING, the gauge) when it falls below;
the manifest and the server's --fidelity-bar turn the bar off. A classifier is held to its top-1 agreement, a
regression model to its relative error."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from halfserve import cli, models, storage
from halfserve.manifest import Precision, load_manifest
from halfserve.precision import cpu_has_native_bf16
from halfserve.settings import FidelityCheck, Settings
from tests.integration.conftest import serving

FEATURES = 16
CLASSES = 10
LINEAR = {"in_features": FEATURES, "hidden": [], "out_features": CLASSES}
HALVES = [
    pytest.param(Precision.BF16, id="bf16"),
    pytest.param(Precision.FP16, id="fp16"),
    pytest.param(
        None,
        id="auto",
        marks=pytest.mark.skipif(not cpu_has_native_bf16(), reason="auto serves fp32 on a CPU without native bf16"),
    ),
]


def fragile_classifier(path: Path) -> Path:
    """A linear classifier whose class weights are one vector w plus 1e-4 noise: its class scores differ by about
    1e-4 of their size, far below what bf16 (2^-8) and fp16 (2^-11) resolve, so half precision picks its classes at
    random."""
    torch.manual_seed(0)
    module = models.build("mlp", **LINEAR)
    w = torch.randn(FEATURES)
    with torch.no_grad():
        module.net[0].weight.copy_(w + 1e-4 * torch.randn(CLASSES, FEATURES))
        module.net[0].bias.zero_()
    torch.save(module.state_dict(), path)
    return path


def import_(source: Path, root: Path, name: str, *extra: str, kwargs: dict[str, object] = LINEAR) -> int:
    return cli.main(
        [
            "import",
            str(source),
            "--store",
            str(root),
            "--name",
            name,
            "--architecture",
            "mlp",
            "--arch-kwargs",
            json.dumps(kwargs),
            "--input",
            f"x:{kwargs['in_features']}",
            "--device",
            "cpu",
            *extra,
        ]
    )


async def entry(client: object, name: str) -> dict[str, object]:
    body = (await client.get("/models")).json()  # type: ignore[attr-defined]
    listed: list[dict[str, object]] = body["models"] if isinstance(body, dict) else body
    return next(m for m in listed if m["name"] == name)


async def fallback_gauge(client: object, name: str) -> float:
    """``halfserve_model_fp32_fallback`` of version 1 of ``name``."""
    text: str = (await client.get("/metrics")).text  # type: ignore[attr-defined]
    series = f'halfserve_model_fp32_fallback{{model="{name}",version="1"}} '
    return float(next(line for line in text.splitlines() if line.startswith(series)).removeprefix(series))


@pytest.fixture(scope="module")
def fragile_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("fragile")
    assert import_(fragile_classifier(root / "weights.pth"), root / "store", "fragile") == 0
    return root / "store"


def test_import_prints_the_figure_and_warns_that_the_server_will_serve_fp32(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert import_(fragile_classifier(tmp_path / "w.pth"), tmp_path / "store", "fragile") == 0
    out = capsys.readouterr().out
    assert "on 64 random samples: top-1 agreement 0." in out
    assert "WARNING: below the fidelity bar" in out
    assert "below the default min_top1_agreement 0.98" in out
    assert "The server will serve this model in fp32" in out
    assert "--fidelity-bar off" in out
    manifest = load_manifest(tmp_path / "store" / "fragile")
    assert manifest.evaluation is not None
    assert manifest.evaluation["bf16_top1_agreement"] < 0.5


@pytest.mark.parametrize("precision", HALVES)
async def test_a_fragile_classifier_is_served_in_fp32_by_default_with_the_reason(
    fragile_store: Path, precision: Precision | None, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="halfserve.repository")
    half = (precision or Precision.BF16).value
    async with serving(Settings(store=fragile_store, precision=precision)) as client:
        listed = await entry(client, "fragile")
        assert listed["precision"] == "fp32"
        f = listed["fidelity"]
        assert isinstance(f, dict)
        assert f["precision"] == half
        assert f["source"] == "random"
        assert f["top1_agreement"] < 0.5  # the classes are noise in half precision
        reason = listed["fp32_fallback"]
        assert isinstance(reason, str)
        assert f"{half} top-1 agreement with fp32 is {f['top1_agreement']:.4f} on 64 random samples" in reason
        assert "below the default min_top1_agreement 0.98" in reason
        assert listed["fidelity_bar"] == {
            "check": True,
            "min_top1_agreement": 0.98,
            "min_cosine": 0.999,
            "max_rel_error": 0.02,
        }
        assert await fallback_gauge(client, "fragile") == 1.0
        r = await client.post("/predict", json={"inputs": [[1.0] * FEATURES]})
        assert r.status_code == 200
        assert r.json()["precision"] == "fp32"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    line = next(m for m in warnings if "model fragile is served in fp32" in m)
    assert f"not {half}" in line
    assert "below the default min_top1_agreement 0.98" in line
    assert "--fidelity-bar off" in line  # how to override


@pytest.mark.parametrize("precision", HALVES)
async def test_with_the_server_s_bar_off_it_is_served_in_half_precision(
    fragile_store: Path, precision: Precision | None
) -> None:
    half = (precision or Precision.BF16).value
    async with serving(Settings(store=fragile_store, precision=precision, fidelity_bar=FidelityCheck.OFF)) as client:
        listed = await entry(client, "fragile")
        assert listed["precision"] == half
        assert listed["fidelity"] is None  # not measured
        assert listed["fp32_fallback"] is None
        assert await fallback_gauge(client, "fragile") == 0.0


@pytest.mark.parametrize("precision", HALVES)
@pytest.mark.parametrize(
    ("bar", "measured"),
    [
        pytest.param('{"check": false}', False, id="check-off"),
        pytest.param('{"min_top1_agreement": 0}', True, id="lowered"),
    ],
)
async def test_with_the_manifest_s_bar_off_or_lowered_it_is_served_in_half_precision(
    tmp_path: Path, precision: Precision | None, bar: str, measured: bool
) -> None:
    half = (precision or Precision.BF16).value
    assert import_(fragile_classifier(tmp_path / "w.pth"), tmp_path / "store", "fragile", "--fidelity", bar) == 0
    async with serving(Settings(store=tmp_path / "store", precision=precision)) as client:
        listed = await entry(client, "fragile")
        assert listed["precision"] == half
        assert listed["fp32_fallback"] is None
        f = listed["fidelity"]
        assert (f is not None) is measured
        if isinstance(f, dict):
            assert f["top1_agreement"] < 0.5  # measured and shown, but the operator lowered the bar below it


@pytest.mark.parametrize("precision", [Precision.BF16, Precision.FP16], ids=str)
async def test_a_regression_model_is_held_to_its_relative_error(tmp_path: Path, precision: Precision) -> None:
    """y = x0 - x1 for inputs near 100 whose difference is within 1: rounding the inputs to half precision (steps of
    0.5 in bf16, 0.0625 in fp16 near 100) moves y by a large part of its range. y = (x0 + x1) / 2 on the same inputs
    moves by a fraction of a percent."""
    kwargs: dict[str, object] = {"in_features": 2, "hidden": [], "out_features": 1}
    rng = np.random.default_rng(0)
    x0 = rng.uniform(99.0, 101.0, 64)
    np.save(tmp_path / "calib.npy", np.stack([x0, x0 + rng.uniform(-1.0, 1.0, 64)], 1).astype(np.float32))
    for name, weights in (("difference", [1.0, -1.0]), ("mean", [0.5, 0.5])):
        module = models.build("mlp", **kwargs)
        with torch.no_grad():
            module.net[0].weight.copy_(torch.tensor([weights]))
            module.net[0].bias.zero_()
        torch.save(module.state_dict(), tmp_path / f"{name}.pth")
        calibration = ["--calibration", str(tmp_path / "calib.npy")]
        assert import_(tmp_path / f"{name}.pth", tmp_path / "store", name, *calibration, kwargs=kwargs) == 0
    async with serving(Settings(store=tmp_path / "store", precision=precision)) as client:
        fragile, healthy = await entry(client, "difference"), await entry(client, "mean")
        for listed in (fragile, healthy):
            f = listed["fidelity"]
            assert isinstance(f, dict)
            assert f["source"] == "calibration"
            assert f["top1_agreement"] is None  # one value per row: nothing to rank
            assert f["min_cosine"] is None
        assert fragile["precision"] == "fp32"
        assert fragile["fidelity"]["max_rel_error"] > 0.02  # type: ignore[index]
        assert "largest relative error from fp32 is" in str(fragile["fp32_fallback"])
        assert "above the default max_rel_error 0.02" in str(fragile["fp32_fallback"])
        assert await fallback_gauge(client, "difference") == 1.0
        assert await fallback_gauge(client, "mean") == 0.0
        assert healthy["precision"] == precision.value
        assert healthy["fidelity"]["max_rel_error"] < 0.02  # type: ignore[index]
        assert healthy["fp32_fallback"] is None
        r = await client.post("/predict", json={"model": "difference", "inputs": [[100.25, 100.0]]})
        assert r.json()["precision"] == "fp32"
        assert r.json()["outputs"][0][0] == pytest.approx(0.25, abs=1e-4)


def test_strict_import_refuses_a_model_below_the_bar_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "store"
    fragile = fragile_classifier(tmp_path / "w.pth")
    assert import_(fragile, root, "fragile", "--strict") == 2
    err = capsys.readouterr().err
    assert "--strict: below the fidelity bar: bf16 top-1 agreement with fp32 is 0." in err
    assert "nothing was written" in err
    assert not (root / "fragile").exists()

    # Beside a version already served, the refused one leaves the folder and its manifest as they were.
    healthy = tmp_path / "healthy.pth"
    torch.manual_seed(1)
    torch.save(models.build("mlp", **LINEAR).state_dict(), healthy)
    assert import_(healthy, root, "fragile", "--strict") == 0
    before = (root / "fragile" / storage.MANIFEST).read_bytes()
    capsys.readouterr()
    assert import_(fragile, root, "fragile", "--strict") == 2
    assert storage.versions(root / "fragile") == [1]
    assert (root / "fragile" / storage.MANIFEST).read_bytes() == before
    # Without --strict it is imported, to be served in fp32.
    assert import_(fragile, root, "fragile") == 0
    assert storage.versions(root / "fragile") == [1, 2]
    assert "will serve this model in fp32" in capsys.readouterr().out


async def test_a_precision_switch_of_a_fallen_back_model_tells_one_story(
    fragile_store: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 50: switched to bf16 by the operator, the model no longer claims its fp32 fallback (listing, gauge), says
    the operator set it against the measurement kept in the listing, and a WARNING names the figure; ``auto``
    re-applies the fallback where it resolves to the precision measured below the bar; fp32 leaves no stale reason."""
    monkeypatch.setattr("halfserve.precision.cpu_has_native_bf16", lambda: True)  # auto resolves to bf16 on a CPU
    caplog.set_level(logging.WARNING, logger="halfserve.repository")

    def warned(text: str) -> list[str]:
        return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and text in r.getMessage()]

    async def switch(client: object, precision: str) -> dict[str, object]:
        r = await client.post("/models/fragile/precision", json={"precision": precision}, headers=auth)  # type: ignore[attr-defined]
        assert r.status_code == 200, r.text
        return await entry(client, "fragile")

    token = "precision-switch-token"
    auth = {"Authorization": f"Bearer {token}"}
    async with serving(Settings(store=fragile_store, precision=Precision.BF16, admin_token=token)) as client:
        listed = await entry(client, "fragile")
        reason, measured = listed["fp32_fallback"], listed["fidelity"]
        assert isinstance(reason, str)
        assert isinstance(measured, dict)
        assert (listed["precision"], listed["precision_source"]) == ("fp32", "fidelity_fallback")
        assert listed["fidelity_shortfall"] == reason
        assert await fallback_gauge(client, "fragile") == 1.0
        figure = f"{measured['top1_agreement']:.4f}"

        listed = await switch(client, "bf16")
        assert (listed["precision"], listed["precision_source"]) == ("bf16", "operator")
        assert listed["fp32_fallback"] is None
        assert listed["fidelity_shortfall"] == reason  # what was measured stays visible, and for which precision
        assert listed["fidelity"] == measured
        assert measured["precision"] == "bf16"
        assert await fallback_gauge(client, "fragile") == 0.0
        [line] = warned("as the operator set it")
        assert line.startswith("model fragile is served in bf16")
        assert f"top-1 agreement with fp32 is {figure}" in line
        assert "below the default min_top1_agreement 0.98" in line

        listed = await switch(client, "auto")
        assert (listed["precision"], listed["precision_source"]) == ("fp32", "fidelity_fallback")
        assert listed["fp32_fallback"] == reason
        assert await fallback_gauge(client, "fragile") == 1.0
        [line] = warned("fell below its fidelity bar at load")
        assert line.startswith("model fragile: auto is bf16 here")
        assert figure in line

        listed = await switch(client, "fp32")
        assert (listed["precision"], listed["precision_source"]) == ("fp32", "operator")
        assert listed["fp32_fallback"] is None
        assert listed["fidelity_shortfall"] == reason
        assert await fallback_gauge(client, "fragile") == 0.0
        assert len(warned("fragile")) == 3  # the load's, bf16's and auto's; fp32 warns of nothing
