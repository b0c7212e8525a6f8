"""A load checks its version's precision record (``precision.json``, written by ``halfserve import``): one measured
under the load's conditions is trusted and nothing is measured; one from another torch version, device kind or
precision, or one that cannot be read, is measured again and the load says why; the record is shown in ``/models``
and in the V2 model metadata's ``parameters``; the store's file is never rewritten by a load."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import pytest
import torch

from halfserve import cli, models
from halfserve.manifest import Precision
from halfserve.settings import FidelityCheck, Settings
from tests.conftest import OPERATOR_NET
from tests.integration.conftest import serving

MLP = {"in_features": 6, "hidden": [8], "out_features": 4}
MARKED = 0.987654
"""A top-1 agreement no measurement of this model gives (64 samples): shown only where the record is trusted."""


@pytest.fixture
def store_dir(tmp_path: Path) -> Path:
    torch.manual_seed(0)
    torch.save(models.build("mlp", **MLP).state_dict(), tmp_path / "w.pth")
    args = ["import", str(tmp_path / "w.pth"), "--store", str(tmp_path / "store"), "--name", "net"]
    args += ["--architecture", "mlp", "--arch-kwargs", json.dumps(MLP), "--input", "x:6", "--device", "cpu"]
    assert cli.main(args) == 0
    return tmp_path / "store"


def edit_record(store_dir: Path, **changes: object) -> Path:
    path = store_dir / "net" / "1" / "precision.json"
    raw = json.loads(path.read_text())
    raw["fidelity"]["top1_agreement"] = MARKED
    path.write_text(json.dumps({**raw, **changes}))
    return path


async def listed(client: object) -> dict[str, object]:
    body = (await client.get("/models")).json()  # type: ignore[attr-defined]
    models_: list[dict[str, object]] = body["models"] if isinstance(body, dict) else body
    return next(m for m in models_ if m["name"] == "net")


async def test_a_matching_record_is_trusted_and_shown_in_models_and_v2_metadata(
    store_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    edit_record(store_dir)
    caplog.set_level(logging.INFO, logger="halfserve.repository")
    async with serving(Settings(store=store_dir, precision=Precision.BF16)) as client:
        entry = await listed(client)
        meta = (await client.get("/v2/models/net")).json()
        versioned = (await client.get("/v2/models/net/versions/1")).json()
    assert entry["precision"] == "bf16"
    shown = entry["precision_record"]
    assert isinstance(shown, dict)
    assert shown["check"] == "trusted"
    assert shown["record"]["fidelity"]["top1_agreement"] == MARKED  # the record's figure: nothing was measured
    assert shown["record"]["torch"] == torch.__version__
    assert shown["record"]["fp32_modules"] == []
    assert entry["fidelity"]["top1_agreement"] == MARKED  # type: ignore[index]
    assert any("bf16 not measured at load: its precision.json matches" in r.getMessage() for r in caplog.records)
    assert meta == versioned
    assert meta["parameters"]["precision"] == "bf16"
    assert json.loads(meta["parameters"]["precision_record"]) == shown


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"torch": "1.13.1"}, "torch version"),
        ({"device": {"type": "cuda", "name": "Tesla T4", "capability": "7.5", "native_bf16": False}}, "device kind"),
        ({"precision": "fp16"}, "precision"),
    ],
    ids=["torch", "device", "precision"],
)
async def test_a_record_from_other_conditions_is_measured_again_and_says_why(
    store_dir: Path, changes: dict[str, object], named: str, caplog: pytest.LogCaptureFixture
) -> None:
    path = edit_record(store_dir, **changes)
    before = path.read_bytes()
    caplog.set_level(logging.INFO, logger="halfserve.repository")
    async with serving(Settings(store=store_dir, precision=Precision.BF16)) as client:
        entry = await listed(client)
    shown = entry["precision_record"]
    assert isinstance(shown, dict)
    assert shown["check"] == "remeasured"
    assert shown["differs"] == [next(iter(changes))]
    own = shown["record"]  # the load's own, measured now
    assert own["fidelity"]["top1_agreement"] != MARKED
    assert own["torch"] == torch.__version__
    assert own["precision"] == "bf16"
    assert entry["precision"] == "bf16"
    assert any(f"measured with another {named}" in r.getMessage() for r in caplog.records)
    assert path.read_bytes() == before  # a load never writes the store


async def test_a_trusted_record_below_the_bar_serves_fp32(store_dir: Path) -> None:
    path = edit_record(store_dir)
    raw = json.loads(path.read_text())
    raw["fidelity"]["top1_agreement"] = 0.5
    path.write_text(json.dumps(raw))
    # No mixed-precision search: the model itself is healthy, so any one module kept in fp32 would meet the bar.
    async with serving(Settings(store=store_dir, precision=Precision.BF16, mixed_search_seconds=0)) as client:
        entry = await listed(client)
    assert entry["precision_record"]["check"] == "trusted"  # type: ignore[index]
    assert entry["precision"] == "fp32"
    assert "bf16 top-1 agreement with fp32 is 0.5000" in str(entry["fp32_fallback"])


@pytest.mark.parametrize(
    "settings",
    [{"precision": Precision.FP32}, {"precision": Precision.BF16, "fidelity_bar": FidelityCheck.OFF}],
    ids=["loaded-in-fp32", "bar-off"],
)
async def test_no_record_is_shown_where_the_load_held_no_half_precision_to_a_bar(
    store_dir: Path, settings: dict[str, object]
) -> None:
    # The store holds a record all the same (the import wrote it): /models shows the load's check, not the file.
    async with serving(Settings(store=store_dir, **settings)) as client:  # type: ignore[arg-type]
        entry = await listed(client)
        meta = (await client.get("/v2/models/net")).json()
    assert (store_dir / "net" / "1" / "precision.json").is_file()
    assert entry["precision"] == settings["precision"].value  # type: ignore[attr-defined]
    assert entry["precision_record"] is None
    assert meta["parameters"]["precision_record"] == ""


async def test_measure_at_every_load_when_told(store_dir: Path) -> None:
    edit_record(store_dir)
    settings = Settings(store=store_dir, precision=Precision.BF16, fidelity_bar=FidelityCheck.MEASURE)
    async with serving(settings) as client:
        entry = await listed(client)
    assert entry["precision_record"]["check"] == "always_measured"  # type: ignore[index]
    assert entry["fidelity"]["top1_agreement"] != MARKED  # type: ignore[index]


@pytest.mark.parametrize("content", [b"\x00\xff garbage", b"{" * 70_000], ids=["corrupt", "oversized"])
async def test_a_corrupt_or_oversized_record_is_ignored_with_a_warning(
    store_dir: Path, content: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    (store_dir / "net" / "1" / "precision.json").write_bytes(content)
    caplog.set_level(logging.WARNING)
    async with serving(Settings(store=store_dir, precision=Precision.BF16)) as client:
        entry = await listed(client)
        assert (await client.post("/predict", json={"inputs": [[1.0] * 6]})).status_code == 200
    shown = entry["precision_record"]
    assert isinstance(shown, dict)
    assert shown["check"] == "ignored"
    assert "precision.json" in shown["problem"]
    assert shown["record"]["torch"] == torch.__version__  # measured at load
    assert entry["precision"] == "bf16"
    assert any("precision.json" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)


async def test_a_version_without_a_record_measures_as_before(store_dir: Path) -> None:
    (store_dir / "net" / "1" / "precision.json").unlink()
    async with serving(Settings(store=store_dir, precision=Precision.BF16)) as client:
        entry = await listed(client)
    assert entry["precision_record"]["check"] == "measured"  # type: ignore[index]
    assert entry["fidelity"]["samples"] == 64  # type: ignore[index]


async def test_a_record_of_code_since_changed_is_measured_again(
    tmp_path: Path, operator_code: Path, caplog: pytest.LogCaptureFixture
) -> None:
    code = operator_code
    (code / "opstale_net.py").write_text(OPERATOR_NET)
    store_dir = tmp_path / "store"
    torch.manual_seed(0)
    torch.save({"l.weight": torch.randn(4, 6), "l.bias": torch.randn(4)}, tmp_path / "w.pth")
    args = ["import", str(tmp_path / "w.pth"), "--store", str(store_dir), "--name", "net", "--code-path", str(code)]
    assert cli.main([*args, "--architecture", "opstale_net:build", "--input", "x:6", "--device", "cpu"]) == 0
    assert json.loads((store_dir / "net" / "1" / "precision.json").read_text())["fidelity"]["top1_agreement"] == 1.0
    # The team's edit: the same answers in fp32, none left in bf16 (1000 + x rounds x to a multiple of 4 there).
    source = code / "opstale_net.py"
    source.write_text(source.read_text().replace("self.l(x)", "self.l((x + 1000.0) - 1000.0)"))
    del sys.modules["opstale_net"]  # as a restarted server imports it afresh
    caplog.set_level(logging.INFO, logger="halfserve.repository")
    settings = Settings(store=store_dir, code_path=[code], precision=Precision.BF16, mixed_search_seconds=0)
    async with serving(settings) as client:
        entry = await listed(client)
    shown = entry["precision_record"]
    assert isinstance(shown, dict)
    assert shown["check"] == "remeasured"
    assert shown["differs"] == ["code"]
    assert entry["precision"] == "fp32"
    assert "bf16 top-1 agreement with fp32" in str(entry["fp32_fallback"])
    assert any("measured with another architecture's code" in r.getMessage() for r in caplog.records)
