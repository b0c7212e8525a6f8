"""Pure pieces of the training module: datasets, standardization folding, the state file, the schedule, the report."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch

from halfserve import models
from halfserve.training import checkpoint, datasets, report
from halfserve.training.checkpoint import TrainState
from halfserve.training.errors import TrainingError, UnknownRecipeError
from halfserve.training.evaluation import evaluate_module
from halfserve.training.recipes import RECIPES, get
from halfserve.training.standardization import Standardize, first_linear, fold, unfold
from halfserve.training.step import cosine_lr


def test_digits_images_are_unit_scaled_8x8_with_a_stratified_split() -> None:
    data = datasets.digits_8x8()
    assert tuple(data.x_train.shape) == (1437, 1, 8, 8)
    assert tuple(data.x_test.shape) == (360, 1, 8, 8)
    assert data.sample_shape == [1, 8, 8]
    assert (float(data.x_train.min()), float(data.x_train.max())) == (0.0, 1.0)
    assert data.labels == tuple(str(i) for i in range(10))
    assert torch.bincount(data.y_test, minlength=10).min() >= 35  # every class in the test split


def test_digits_upsampled_are_256_features_matching_the_benchmark_mlp() -> None:
    data = datasets.digits_16x16_flat()
    assert data.sample_shape == [256]
    assert RECIPES["digits_mlp"].arch_kwargs["in_features"] == 256
    assert tuple(RECIPES["digits_mlp"].arch_kwargs["hidden"]) == (1024, 1024)
    # Same split as the 8x8 images: the split depends only on the labels and the fixed seed.
    assert torch.equal(data.y_test, datasets.digits_8x8().y_test)


def test_breast_cancer_features_stay_raw() -> None:
    data = datasets.breast_cancer()
    assert data.sample_shape == [30]
    assert data.labels == ("malignant", "benign")
    assert float(data.x_train.max()) > 1000  # unstandardized: clients send raw features
    assert data.describe()["n_train"] == 455


def test_unknown_recipe_names_the_choices() -> None:
    with pytest.raises(UnknownRecipeError, match="digits_cnn, digits_mlp, digits_transformer, tabular"):
        get("mnist")
    assert issubclass(UnknownRecipeError, TrainingError)


# Standardization -------------------------------------------------------------------------------------------------


def _stats() -> tuple[Standardize, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(200, 30, generator=g) * torch.linspace(0.01, 500, 30) + torch.linspace(-3, 1000, 30)
    return Standardize.fit(x), x


def test_fold_makes_the_model_take_raw_features() -> None:
    standardize, x = _stats()
    torch.manual_seed(0)
    model = models.build("mlp", in_features=30, hidden=[64, 64], out_features=2)
    two_step = torch.nn.Sequential(standardize, model)(x)
    folded = fold(standardize, copy.deepcopy(model))
    torch.testing.assert_close(folded(x), two_step, rtol=1e-4, atol=1e-4)
    assert isinstance(first_linear(folded), torch.nn.Linear)


def test_unfold_undoes_fold() -> None:
    standardize, _ = _stats()
    torch.manual_seed(0)
    model = models.build("mlp", in_features=30, hidden=[8], out_features=2)
    original = copy.deepcopy(model.state_dict())
    unfold(standardize, fold(standardize, model))
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, original[name], rtol=1e-5, atol=1e-5)


def test_standardize_fit_uses_train_statistics_and_guards_constant_columns() -> None:
    x = torch.tensor([[1.0, 5.0], [3.0, 5.0]])
    s = Standardize.fit(x)
    torch.testing.assert_close(s.mean, torch.tensor([2.0, 5.0]))
    torch.testing.assert_close(s.std, torch.tensor([1.0, 1.0]))
    torch.testing.assert_close(s(x), torch.tensor([[-1.0, 0.0], [1.0, 0.0]]))


def test_fold_rejects_a_width_mismatch() -> None:
    standardize, _ = _stats()
    with pytest.raises(ValueError, match="takes 4 features"):
        fold(standardize, models.build("mlp", in_features=4, hidden=[], out_features=2))


# Training state --------------------------------------------------------------------------------------------------


def _state(**changes: object) -> TrainState:
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    fields: dict[str, object] = {
        "recipe": "tabular",
        "precision": "fp16",
        "epoch": 2,
        "step": 7,
        "skipped_steps": 1,
        "seed": 0,
        "seconds": 1.5,
        "optimizer": opt.state_dict(),
        "scaler": torch.amp.GradScaler("cpu").state_dict(),
    }
    fields.update(changes)
    return TrainState(**fields)  # type: ignore[arg-type]


def test_state_round_trips_through_weights_only_load(tmp_path: Path) -> None:
    state = _state()
    checkpoint.save(tmp_path, state)
    back = checkpoint.load(tmp_path)
    assert (back.recipe, back.epoch, back.step, back.skipped_steps, back.scaler) == (
        "tabular",
        2,
        7,
        1,
        state.scaler,
    )
    assert torch.equal(back.optimizer["state"][0]["exp_avg"], state.optimizer["state"][0]["exp_avg"])


def test_state_with_a_wrong_field_is_rejected(tmp_path: Path) -> None:
    checkpoint.save(tmp_path, _state(step="seven"))
    with pytest.raises(TrainingError, match="step: missing or of the wrong type"):
        checkpoint.load(tmp_path)


def test_state_from_a_future_format_is_rejected(tmp_path: Path) -> None:
    torch.save({"format": 99}, tmp_path / checkpoint.STATE_FILE)
    with pytest.raises(TrainingError, match="format: expected 1"):
        checkpoint.load(tmp_path)


# Schedule and report ---------------------------------------------------------------------------------------------


def test_cosine_lr_decays_from_base_to_a_tenth() -> None:
    rates = [cosine_lr(1.0, i, 50) for i in range(50)]
    assert rates[0] == pytest.approx(1.0)
    assert rates[-1] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(rates, rates[1:], strict=False))
    assert cosine_lr(1.0, 0, 1) == pytest.approx(1.0)


def test_report_writes_strict_json_even_with_inf_gradients(tmp_path: Path) -> None:
    history = report.History()
    history.record_step(step=1, epoch=1, loss=2.0, loss_scale=65536.0, skipped=True, grad_norm=math.inf, lr=1e-3)
    history.record_step(step=2, epoch=1, loss=1.5, loss_scale=32768.0, skipped=False, grad_norm=0.5, lr=1e-3)
    history.record_epoch(epoch=1, steps=2, train_loss=1.7, train_accuracy=0.5, test_accuracy=0.6, partial=False)
    files = report.write(tmp_path, history, {"recipe": "x", "version": 1, "precision": "fp16"})
    assert [f.name for f in files] == [report.METRICS_FILE, *report.PLOT_FILES]
    text = (tmp_path / report.REPORT_DIR / report.METRICS_FILE).read_text()
    metrics = json.loads(text, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
    assert metrics["steps"][0]["grad_norm"] is None
    assert report.History.load(tmp_path).steps == history.steps


def test_report_history_of_a_missing_version_is_empty(tmp_path: Path) -> None:
    assert report.History.load(tmp_path) == report.History()


# Evaluation ------------------------------------------------------------------------------------------------------


def test_evaluation_reports_fp16_overflow_that_bf16_survives() -> None:
    model = torch.nn.Linear(2, 2)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1e5, 0.0], [0.0, 1.0]]))  # 1e5 is past fp16's 65504, not bf16's range
        model.bias.zero_()
    x = torch.tensor([[1.0, 0.5], [-1.0, 0.5], [0.5, 2.0]])
    y = torch.tensor([0, 1, 0])
    result = evaluate_module(model, x, y, torch.device("cpu"))
    out = result.as_dict()
    assert out["test_samples"] == 3
    assert out["fp32_accuracy"] == pytest.approx(1.0)
    assert out["fp16_max_abs_logit_diff"] is None  # overflowed: unbounded, and JSON-safe
    assert 0 < out["bf16_max_abs_logit_diff"] < 1e3
    assert out["bf16_top1_agreement"] == 1.0
    json.dumps(out, allow_nan=False)
