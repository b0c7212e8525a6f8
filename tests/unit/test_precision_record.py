"""The precision record a version's import writes (``precision.json``): read back whole, checked against a load's
conditions, and a corrupt, oversized or foreign file refused as a record, never trusted."""

from __future__ import annotations

import dataclasses
import importlib
import json
from pathlib import Path

import pytest
import torch

from halfserve import codedigest, fidelity, models, precision, precision_record
from halfserve.importer import describe, import_model
from halfserve.manifest import Precision, TensorSpec, load_manifest
from halfserve.precision_record import RecordCheck, RecordError
from halfserve.version import __version__
from tests.conftest import OPERATOR_NET

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
    assert record.code == codedigest.OWN  # halfserve's own model: its code is the version's
    assert record.halfserve == __version__
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
        ("code", "sha256:" + "0" * 64, "code"),
        ("halfserve", "0.0.1", "halfserve"),
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


def test_a_record_from_before_records_held_the_code_is_measured_again(imported: Path) -> None:
    raw = json.loads((imported / "precision.json").read_text())
    del raw["code"], raw["halfserve"]
    (imported / "precision.json").write_text(json.dumps(raw))
    check = precision_record.at_load(imported, conditions_now(imported), measure_always=False)
    assert check.check is RecordCheck.REMEASURED
    assert check.differs == ["code", "halfserve"]
    assert "measured with another architecture's code, halfserve version" in check.why()


@pytest.fixture
def code_dir(operator_code: Path) -> Path:
    """A --code-path folder of the operator's, with a package and a single-file module beside a helper."""
    (operator_code / "opdigest_pkg" / "layers").mkdir(parents=True)
    (operator_code / "opdigest_pkg" / "__init__.py").write_text("")
    (operator_code / "opdigest_pkg" / "layers" / "__init__.py").write_text("SHIFT = 0.0\n")
    (operator_code / "opdigest_pkg" / "net.py").write_text(OPERATOR_NET)
    (operator_code / "opdigest_one.py").write_text(OPERATOR_NET)
    (operator_code / "opdigest_helper.py").write_text("SCALE = 1.0\n")
    importlib.invalidate_caches()
    models.add_code_path([operator_code])
    return operator_code


@pytest.mark.parametrize(
    ("architecture", "edited", "digested"),
    [
        ("opdigest_pkg.net:build", "opdigest_pkg/net.py", True),
        ("opdigest_pkg.net:build", "opdigest_pkg/layers/__init__.py", True),  # a module of its package it imports
        ("opdigest_pkg.net:build", "opdigest_helper.py", False),  # outside its package
        ("opdigest_one:build", "opdigest_one.py", True),
        ("opdigest_one:build", "opdigest_helper.py", True),  # a helper beside it it may import
        ("opdigest_one:build", "opdigest_pkg/net.py", False),
    ],
)
def test_the_operators_code_is_digested_so_an_edit_is_seen(
    code_dir: Path, architecture: str, edited: str, digested: bool
) -> None:
    models.build(architecture)  # imported, as a load has built it
    before = codedigest.of(architecture)
    assert before is not None
    assert before.startswith("sha256:")
    assert codedigest.of(architecture) == before
    path = code_dir / edited
    path.write_text(path.read_text().replace("return self.l(x)", "return self.l((x + 1000.0) - 1000.0)") + "\n# 2\n")
    assert (codedigest.of(architecture) != before) is digested


def test_too_much_code_to_digest_is_never_trusted(code_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    models.build("opdigest_pkg.net:build")
    monkeypatch.setattr(codedigest, "MAX_FILES", 2)  # the package holds 3 source files
    assert codedigest.of("opdigest_pkg.net:build") is None
    monkeypatch.setattr(codedigest, "MAX_FILES", 100)
    monkeypatch.setattr(codedigest, "MAX_BYTES", 10)
    assert codedigest.of("opdigest_pkg.net:build") is None
    monkeypatch.undo()
    under = conditions_of("opdigest_pkg.net:build")
    untold = dataclasses.replace(under, code=None)
    record = precision_record.measured(untold, fidelity.Fidelity(64, "bf16", 1.0, 0.0, None))
    assert record.conditions().differs(untold) == ["code"]  # not even by a load that cannot tell either
    check = precision_record.AtLoad(RecordCheck.REMEASURED, untold, record, ["code"])
    assert check.why().endswith("(this load cannot digest the architecture's code, so no record of it is trusted)")


def conditions_of(architecture: str) -> precision_record.Conditions:
    return precision_record.Conditions("bf16", {}, torch.__version__, {}, "0", code=codedigest.of(architecture))
