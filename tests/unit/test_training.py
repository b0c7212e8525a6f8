"""Training end to end on the small ``tabular`` recipe: the store version, manifest, report, state, resume and CLI."""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from halfserve import storage, store
from halfserve.manifest import load_manifest
from halfserve.training import RECIPES, TrainConfig, TrainingError, TrainResult, train
from halfserve.training import cli as train_cli
from halfserve.training.checkpoint import STATE_FILE
from halfserve.training.report import METRICS_FILE, PLOT_FILES, REPORT_DIR
from halfserve.training.standardization import Standardize

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
EVALUATION_KEYS = {
    "test_samples",
    "fp32_accuracy",
    "fp16_accuracy",
    "bf16_accuracy",
    "fp16_top1_agreement",
    "bf16_top1_agreement",
}
STEPS_PER_EPOCH = 455 // 32  # tabular: 455 training rows, batch 32, ragged tail dropped


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> TrainResult:
    """One epoch of ``tabular`` in bf16, shared by the read-only checks below."""
    return train("tabular", tmp_path_factory.mktemp("store"), epochs=1, device="cpu", precision="bf16")


def metrics_of(version_dir: Path) -> dict:
    return json.loads((version_dir / REPORT_DIR / METRICS_FILE).read_text())


def test_writes_a_numbered_version_with_weights_state_and_report(trained: TrainResult) -> None:
    vdir = trained.version_dir
    assert (trained.version, vdir.name, vdir.parent.name) == (1, "1", "tabular")
    assert (vdir / storage.WEIGHTS).is_file()
    assert (vdir / STATE_FILE).is_file()
    for name in PLOT_FILES:
        data = (vdir / REPORT_DIR / name).read_bytes()
        assert data.startswith(PNG_MAGIC), name
        assert len(data) > 5_000, name


def test_manifest_describes_the_served_model(trained: TrainResult) -> None:
    manifest = load_manifest(trained.version_dir.parent)
    assert manifest == trained.manifest
    assert manifest.architecture == "mlp"
    assert manifest.arch_kwargs == {"in_features": 30, "hidden": [64, 64], "out_features": 2, "dropout": 0.1}
    assert (manifest.inputs[0].name, manifest.inputs[0].shape) == ("features", [30])
    assert (manifest.outputs[0].name, manifest.outputs[0].shape) == ("logits", [2])
    assert manifest.labels == ["malignant", "benign"]
    assert manifest.precision == "auto"
    assert (manifest.batching.max_batch_size, manifest.batching.max_delay_ms) == (64, 2.0)
    assert manifest.dataset is not None
    assert manifest.dataset["source"] == "sklearn.datasets.load_breast_cancer"
    assert (manifest.dataset["n_train"], manifest.dataset["n_test"]) == (455, 114)
    assert manifest.training is not None
    assert manifest.training["precision"] == "bf16"
    assert (manifest.training["epochs"], manifest.training["steps"]) == (1, STEPS_PER_EPOCH)
    assert manifest.training["skipped_steps"] == 0
    assert manifest.evaluation is not None
    assert set(manifest.evaluation) >= EVALUATION_KEYS
    assert manifest.evaluation["test_samples"] == 114
    for key in EVALUATION_KEYS - {"test_samples"}:
        assert 0.0 <= manifest.evaluation[key] <= 1.0, key


def test_metrics_have_one_entry_per_step_and_per_epoch(trained: TrainResult) -> None:
    metrics = metrics_of(trained.version_dir)
    steps = metrics["steps"]
    assert [s["step"] for s in steps] == list(range(1, STEPS_PER_EPOCH + 1))
    for s in steps:
        assert s["loss"] > 0
        assert s["loss_scale"] == 1.0  # bf16: GradScaler disabled
        assert s["skipped"] is False
    assert len(metrics["epochs"]) == 1
    assert metrics["epochs"][0]["steps"] == STEPS_PER_EPOCH
    assert metrics["evaluation"] == trained.manifest.evaluation


def test_served_checkpoint_takes_raw_features(trained: TrainResult) -> None:
    """Standardization is folded into the weights: the stored ``mlp`` on raw features scores what training did."""
    last_epoch = metrics_of(trained.version_dir)["epochs"][-1]
    assert trained.evaluation.accuracy["fp32"] == pytest.approx(last_epoch["test_accuracy"])
    loaded = store.load(trained.version_dir.parent.parent, "tabular")
    assert not any(isinstance(m, Standardize) for m in loaded.module.modules())


def test_train_state_loads_with_weights_only(trained: TrainResult) -> None:
    state = torch.load(trained.version_dir / STATE_FILE, weights_only=True)
    assert (state["recipe"], state["step"], state["epoch"], state["precision"]) == (
        "tabular",
        STEPS_PER_EPOCH,
        1,
        "bf16",
    )
    assert set(state["optimizer"]) == {"state", "param_groups"}
    assert state["scaler"] == {}


def test_resume_continues_the_step_count_in_a_new_version(tmp_path: Path) -> None:
    first = train("tabular", tmp_path, max_steps=3, device="cpu", precision="bf16")
    second = train("tabular", tmp_path, max_steps=2, resume=True, device="cpu", precision="bf16")
    assert (first.version, second.version) == (1, 2)
    assert (second.steps, second.run_steps) == (5, 2)
    assert second.manifest.training is not None
    assert second.manifest.training["steps"] == 5
    assert second.manifest.training["resumed_from_version"] == 1
    assert [s["step"] for s in metrics_of(second.version_dir)["steps"]] == [1, 2, 3, 4, 5]
    state = torch.load(second.version_dir / STATE_FILE, weights_only=True)
    assert state["step"] == 5
    # AdamW's own per-parameter step counter continued too: the optimizer state was restored, not rebuilt.
    assert all(int(s["step"]) == 5 for s in state["optimizer"]["state"].values())
    # Version 1 is untouched.
    assert load_manifest(tmp_path / "tabular").training["steps"] == 5
    assert torch.load(first.version_dir / STATE_FILE, weights_only=True)["step"] == 3


def test_resume_starts_from_the_saved_weights(tmp_path: Path) -> None:
    first = train("tabular", tmp_path, epochs=2, device="cpu", precision="bf16")
    # A tiny learning rate: if resume restarted from random weights, accuracy would collapse.
    second = train("tabular", tmp_path, max_steps=1, lr=1e-9, resume=True, device="cpu", precision="bf16")
    assert second.evaluation.accuracy["fp32"] == pytest.approx(first.evaluation.accuracy["fp32"], abs=0.01)
    assert first.evaluation.accuracy["fp32"] > 0.8


def test_fp16_training_uses_a_live_loss_scale(tmp_path: Path) -> None:
    result = train("tabular", tmp_path, max_steps=3, device="cpu", precision="fp16", save_state=False)
    steps = metrics_of(result.version_dir)["steps"]
    assert [s["loss_scale"] for s in steps] == [65536.0] * 3
    assert result.manifest.training is not None
    assert result.manifest.training["precision"] == "fp16"
    assert not (result.version_dir / STATE_FILE).exists()


def test_default_precision_is_bf16_on_cpu() -> None:
    config = TrainConfig.create("tabular", device="cpu")
    assert (config.precision, config.epochs, config.batch_size) == ("bf16", RECIPES["tabular"].epochs, 32)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"epochs": 0}, "epochs must be at least 1"),
        ({"max_steps": 0}, "max_steps must be at least 1"),
        ({"lr": -1.0}, "lr must be a positive number"),
        (
            {"lr": 1e39},
            r"lr must be a positive number up to 1e\+06, got 1e\+39",
        ),  # AdamW's step overflowed: a traceback
        ({"precision": "fp8"}, "unknown precision"),
        ({"device": "nonsense"}, "invalid device"),
    ],
)
def test_bad_options_are_training_errors(options: dict, message: str) -> None:
    with pytest.raises(TrainingError, match=message):
        TrainConfig.create("tabular", **options)


# CLI -------------------------------------------------------------------------------------------------------------


def test_cli_trains_and_prints_a_summary(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = train_cli.main(["tabular", "--store", str(tmp_path), "--max-steps", "2", "--no-progress", "--no-state"])
    out = capsys.readouterr().out
    assert code == 0
    assert "tabular v1" in out
    assert "top-1 agreement with fp32" in out
    assert (tmp_path / "tabular" / "1" / storage.WEIGHTS).is_file()
    assert not (tmp_path / "tabular" / "1" / STATE_FILE).exists()


def test_add_parser_registers_train_on_a_parent_cli(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser(prog="halfserve")
    train_cli.add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["train", "tabular", "--store", str(tmp_path), "--max-steps", "1", "--no-progress"])
    assert (args.recipe, args.precision, args.resume, args.save_state, args.progress) == (
        "tabular",
        None,
        False,
        True,
        False,
    )
    assert args.func(args) == 0


def _fails(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    code = train_cli.main(argv)
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1, err  # one line, no traceback
    assert err.startswith("halfserve train: error: ")
    return err


def test_cli_bad_recipe_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = _fails(["no_such_recipe", "--store", str(tmp_path)], capsys)
    assert "unknown recipe 'no_such_recipe'" in err
    assert "digits_cnn" in err


def test_cli_unwritable_store_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    err = _fails(["tabular", "--store", str(blocker / "store"), "--max-steps", "1"], capsys)
    assert "cannot write to model store" in err


def test_cli_resume_without_a_version_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = _fails(["tabular", "--store", str(tmp_path), "--resume"], capsys)
    assert "no version of 'tabular' to resume from" in err


def test_cli_resume_without_state_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    train("tabular", tmp_path, max_steps=1, device="cpu", save_state=False)
    err = _fails(["tabular", "--store", str(tmp_path), "--resume"], capsys)
    assert STATE_FILE in err
    assert "--no-state" in err


def test_resume_refuses_a_state_that_is_not_plain_data(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    result = train("tabular", tmp_path, max_steps=1, device="cpu")
    # Anything beyond tensors and containers needs full unpickling, which weights_only refuses.
    torch.save({"format": 1, "payload": shutil.copy}, result.version_dir / STATE_FILE)
    err = _fails(["tabular", "--store", str(tmp_path), "--resume"], capsys)  # one line: no warning before it
    assert "cannot read training state" in err
    assert "shutil.copy" in err


@pytest.mark.parametrize("kind", ["folder", "fifo"])
def test_resume_names_a_state_that_is_not_a_regular_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str
) -> None:
    result = train("tabular", tmp_path, max_steps=1, device="cpu", save_state=False)
    state = result.version_dir / STATE_FILE
    if kind == "folder":
        state.mkdir()
    else:
        os.mkfifo(state)  # a read of it would block for ever
    err = _fails(["tabular", "--store", str(tmp_path), "--resume"], capsys)
    assert f"{state}: not a regular file; the training state is one" in err


def test_a_new_version_keeps_the_serving_settings_the_operator_wrote(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    train("tabular", tmp_path, max_steps=1, device="cpu", save_state=False)
    path = tmp_path / "tabular" / storage.MANIFEST
    written = json.loads(path.read_text())
    written.update(version=1, precision="fp32", fidelity={"min_top1_agreement": 0.999})
    written["batching"]["max_batch_size"] = 8
    path.write_text(json.dumps(written))
    code = train_cli.main(["tabular", "--store", str(tmp_path), "--max-steps", "1", "--no-progress", "--no-state"])
    assert code == 0
    assert 'config.json pins version 1: the server goes on serving it (remove its "version" to serve v2)' in (
        capsys.readouterr().out
    )
    kept = load_manifest(tmp_path / "tabular")
    assert (kept.version, kept.precision.value, kept.batching.max_batch_size) == (1, "fp32", 8)
    assert kept.fidelity is not None
    assert kept.fidelity.min_top1_agreement == 0.999
    assert kept.training is not None
    assert kept.training["steps"] == 1  # the recipe's own fields are the new run's
    assert storage.versions(tmp_path / "tabular") == [1, 2]


def test_a_manifest_training_would_overwrite_unread_stops_it_before_it_trains(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    train("tabular", tmp_path, max_steps=1, device="cpu", save_state=False)
    path = tmp_path / "tabular" / storage.MANIFEST
    path.write_text('{"name": "tabular", "precision": "fp32",')  # cut short while being edited
    err = _fails(["tabular", "--store", str(tmp_path), "--max-steps", "1", "--no-progress"], capsys)
    assert f"{path}: " in err
    assert "fix it, or move it away for the recipe's own, before training" in err
    assert path.read_text() == '{"name": "tabular", "precision": "fp32",'
    assert storage.versions(tmp_path / "tabular") == [1]


def test_training_past_the_highest_version_number_stops_before_it_trains(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    train("tabular", tmp_path, max_steps=1, device="cpu", save_state=False)
    (tmp_path / "tabular" / "1").rename(tmp_path / "tabular" / "999999999")
    err = _fails(["tabular", "--store", str(tmp_path), "--max-steps", "1", "--no-progress"], capsys)
    assert "999999999 is the highest number a version may have (9 digits)" in err
    assert sorted(p.name for p in (tmp_path / "tabular").iterdir()) == ["999999999", storage.MANIFEST]
