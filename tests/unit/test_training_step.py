"""The mixed-precision step: call order, skipped fp16 steps on inf gradients, and clipping of the true norm."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from halfserve import models
from halfserve.precision import grad_scaler
from halfserve.training.step import StepResult, train_step

CPU = torch.device("cpu")


def tiny_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return models.build("mlp", in_features=6, hidden=[16], out_features=3)


def batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)


def params_of(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def step(model: nn.Module, opt: torch.optim.Optimizer, scaler: torch.amp.GradScaler, dtype: torch.dtype) -> StepResult:
    x, y = batch()
    return train_step(model, x, y, opt, scaler, dtype=dtype, device=CPU, max_grad_norm=1.0)


class Recorder:
    """Wraps the scaler, optimizer and clipping so a test can read back the order of calls."""

    def __init__(self, scaler: torch.amp.GradScaler, opt: torch.optim.Optimizer, monkeypatch: pytest.MonkeyPatch):
        self.calls: list[str] = []
        self.norms_seen_by_clip: list[float] = []
        for name in ("scale", "unscale_", "step", "update"):
            self._wrap(scaler, name, f"scaler.{name}")
        self._wrap(opt, "step", "optimizer.step")
        self._wrap(opt, "zero_grad", "optimizer.zero_grad")
        clip = torch.nn.utils.clip_grad_norm_

        def recording_clip(params: object, max_norm: float, *args: object, **kwargs: object) -> torch.Tensor:
            self.calls.append("clip_grad_norm_")
            norm = clip(params, max_norm, *args, **kwargs)  # type: ignore[arg-type]
            self.norms_seen_by_clip.append(float(norm))
            return norm

        monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", recording_clip)

    def _wrap(self, obj: object, name: str, label: str) -> None:
        original: Callable[..., object] = getattr(obj, name)

        def wrapper(*args: object, **kwargs: object) -> object:
            self.calls.append(label)
            return original(*args, **kwargs)

        setattr(obj, name, wrapper)


NANOGPT_ORDER = [
    "scaler.scale",
    "scaler.unscale_",
    "clip_grad_norm_",
    "scaler.step",
    "optimizer.step",
    "scaler.update",
    "optimizer.zero_grad",
]


def test_bf16_step_runs_in_order_and_updates_the_parameters(monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = grad_scaler(torch.bfloat16, CPU)
    assert not scaler.is_enabled()
    recorder = Recorder(scaler, opt, monkeypatch)
    before = params_of(model)

    result = step(model, opt, scaler, torch.bfloat16)

    assert recorder.calls == NANOGPT_ORDER
    assert not same(before, params_of(model))
    assert all(p.grad is None for p in model.parameters())  # zero_grad(set_to_none=True)
    assert (result.loss_scale, result.skipped) == (1.0, False)
    assert result.loss > 0
    assert 0 <= result.correct <= 8


def test_fp16_step_clips_the_unscaled_gradient(monkeypatch: pytest.MonkeyPatch) -> None:
    """unscale_ runs before clipping, so the clip sees the true norm, not one 65536 times larger."""
    reference = tiny_model()
    x, y = batch()
    nn.functional.cross_entropy(reference(x), y).backward()
    true_norm = float(torch.nn.utils.get_total_norm([p.grad for p in reference.parameters() if p.grad is not None]))

    model = tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = grad_scaler(torch.float16, CPU)
    recorder = Recorder(scaler, opt, monkeypatch)
    result = step(model, opt, scaler, torch.float16)

    assert recorder.calls == NANOGPT_ORDER
    assert result.loss_scale == 65536.0
    assert recorder.norms_seen_by_clip == [pytest.approx(true_norm, rel=0.02)]
    assert result.grad_norm == pytest.approx(true_norm, rel=0.02)


def test_fp16_inf_gradient_skips_the_step_and_halves_the_scale() -> None:
    model = tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = grad_scaler(torch.float16, CPU)
    poisoned = {"left": 1}

    def inject_inf(grad: torch.Tensor) -> torch.Tensor:
        if poisoned["left"]:
            poisoned["left"] -= 1
            return torch.full_like(grad, float("inf"))
        return grad

    first_weight = next(model.parameters())
    first_weight.register_hook(inject_inf)
    before = params_of(model)

    skipped = step(model, opt, scaler, torch.float16)

    assert skipped.skipped is True
    assert skipped.loss_scale == 65536.0
    assert same(before, params_of(model))  # the optimizer did not move anything
    assert opt.state == {} or all(int(s["step"]) == 0 for s in opt.state.values())
    assert scaler.get_scale() == 32768.0

    clean = step(model, opt, scaler, torch.float16)

    assert clean.skipped is False
    assert clean.loss_scale == skipped.loss_scale / 2
    assert not same(before, params_of(model))
    assert scaler.get_scale() == 32768.0  # no growth until growth_interval clean steps
