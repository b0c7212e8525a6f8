"""The precision record a version's import writes (``precision.json``): read back whole, checked against a load's
conditions, and a corrupt, oversized or foreign file refused as a record, never trusted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from halfserve import fidelity, models, precision, precision_record
from halfserve.importer import describe, import_model
from halfserve.manifest import Precision, TensorSpec, load_manifest
from halfserve.precision_record import RecordCheck, RecordError

MLP = {"in_features": 6, "hidden": [8], "out_features": 4}
FEATURES = [TensorSpec(name="features", shape=[6])]
CPU = torch.device("cpu")


@pytest.fixture
def imported(tmp_path: Path) -> Path:
    torch.manual_seed(0)
    torch.save(models.build("mlp", **MLP).state_dict(), tmp_path / "w.pth")
    result = import_model(tmp_path / "w.pth", tmp_path / "store", "net", "mlp", FEATURES, arch_kwargs=MLP, device=CPU)
    assert "precision record: precision.json, bf16 measured on cpu with torch" in describe(result)
    return result.version_dir


def conditions_now(version_dir: Path) -> precision_record.Conditions:
    manifest = load_manifest(version_dir.parent)
    kind = precision.device_kind(CPU)
    return precision_record.conditions(version_dir, manifest, Precision.BF16, fidelity.bar(manifest), kind)


def test_import_writes_the_record_and_it_reads_back_whole(imported: Path) -> None:
    record = precision_record.read(imported)
    assert record is not None
    assert record.precision == "bf16"
    assert record.torch == torch.__version__
    assert record.device == precision.device_kind(CPU).as_dict()
    assert record.bar == fidelity.DEFAULT_BAR.as_dict()
    assert record.fidelity.samples == 64
    assert record.fidelity.source == "random"
    assert record.fp32_modules == []
    assert record.measured_at.endswith("+00:00")
    # the load under the same conditions trusts it
    check = precision_record.at_load(imported, conditions_now(imported), measure_always=False)
    assert check.check is RecordCheck.TRUSTED
    assert check.trusted == record
    assert precision_record.at_load(imported, conditions_now(imported), measure_always=True).trusted is None


@pytest.mark.parametrize(
    ("field", "value", "named"),
    [
        ("torch", "1.0.0", "torch"),
        ("device", {"type": "cuda", "name": "Tesla T4", "capability": "7.5", "native_bf16": False}, "device"),
        ("precision", "fp16", "precision"),
        ("bar", {**fidelity.DEFAULT_BAR.as_dict(), "min_cosine": 0.5}, "bar"),
        ("files_digest", "0" * 64, "files_digest"),
    ],
)
def test_a_record_measured_under_other_conditions_is_not_trusted(
    imported: Path, field: str, value: object, named: str
) -> None:
    raw = json.loads((imported / "precision.json").read_text())
    (imported / "precision.json").write_text(json.dumps({**raw, field: value}))
    check = precision_record.at_load(imported, conditions_now(imported), measure_always=False)
    assert check.check is RecordCheck.REMEASURED
    assert check.differs == [named]
    assert check.trusted is None


def test_changed_weights_change_the_digest(imported: Path) -> None:
    before = conditions_now(imported).files_digest
    with (imported / "model.safetensors").open("ab") as f:
        f.write(b"\0")
    assert conditions_now(imported).files_digest != before


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (b"{not json", "not valid JSON"),
        (b'{"format": 1, "precision": "bf16"}', "not a valid precision record"),
        (b'{"format": 99}', "not a precision record of format 1"),
        (b"[1, 2]", "not a precision record"),
        (b" " * (precision_record.MAX_RECORD_BYTES + 1), "over the 65536-byte limit"),
    ],
    ids=["not-json", "fields-missing", "other-format", "not-an-object", "oversized"],
)
def test_a_corrupt_or_oversized_record_is_ignored_with_a_warning(
    imported: Path, content: bytes, problem: str, caplog: pytest.LogCaptureFixture
) -> None:
    (imported / "precision.json").write_bytes(content)
    with pytest.raises(RecordError, match=problem):
        precision_record.read(imported)
    with caplog.at_level("WARNING", logger="halfserve.precision_record"):
        check = precision_record.at_load(imported, conditions_now(imported), measure_always=False)
    assert check.check is RecordCheck.IGNORED
    assert check.trusted is None
    assert problem in (check.problem or "")
    assert any(problem in r.getMessage() for r in caplog.records)


def test_a_version_without_a_record_measures(imported: Path) -> None:
    (imported / "precision.json").unlink()
    assert precision_record.read(imported) is None
    check = precision_record.at_load(imported, conditions_now(imported), measure_always=False)
    assert check.check is RecordCheck.MEASURED
    assert check.shown(None) == {"check": "measured", "differs": [], "problem": None, "record": None, "caveat": None}
