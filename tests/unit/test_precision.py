"""The precision policy: mode resolution, casting once, inputs, autocast and the GradScaler factory."""

from __future__ import annotations

import pytest
import torch

from halfserve import models, precision
from halfserve.manifest import Precision

CPU = torch.device("cpu")


def test_auto_is_fp16_on_cuda_and_never_fp16_on_cpu() -> None:
    assert precision.resolve("auto", torch.device("cuda")) is Precision.FP16
    on_cpu = precision.resolve("auto", CPU)
    assert on_cpu is (Precision.BF16 if precision.cpu_has_native_bf16() else Precision.FP32)
    assert precision.resolve("fp16", CPU) is Precision.FP16  # an explicit choice is honoured


@pytest.mark.parametrize(
    ("mode", "dtype"),
    [("fp16", torch.float16), ("bf16", torch.bfloat16), ("fp32", torch.float32), ("autocast", torch.float32)],
)
def test_prepare_model_casts_every_weight_once(mode: str, dtype: torch.dtype) -> None:
    model = precision.prepare_model(models.build("small_cnn", width=4), Precision(mode), CPU)
    assert not model.training
    assert {p.dtype for p in model.parameters()} == {dtype}
    x = precision.cast_input(torch.zeros(2, 1, 8, 8), Precision(mode))
    assert x.dtype == dtype
    with precision.inference(Precision(mode), CPU):
        y = model(x)
    assert y.shape == (2, 10)
    # autocast computes in bf16 on the CPU although the weights stay fp32
    assert y.dtype == (torch.bfloat16 if mode in ("bf16", "autocast") else dtype)


def test_integer_inputs_are_not_cast() -> None:
    assert precision.cast_input(torch.arange(3), Precision.FP16).dtype == torch.int64


def test_grad_scaler_is_live_only_for_fp16() -> None:
    assert not precision.grad_scaler(torch.bfloat16, CPU).is_enabled()
    assert not precision.grad_scaler(torch.float32, CPU).is_enabled()
    assert precision.grad_scaler(torch.float16, CPU).is_enabled()


def test_training_autocast_is_off_for_fp32() -> None:
    with precision.training_autocast(torch.float32, CPU):
        assert not torch.is_autocast_enabled("cpu")
    with precision.training_autocast(torch.bfloat16, CPU):
        assert torch.is_autocast_enabled("cpu")


@pytest.mark.parametrize("enabled", [True, False])
def test_set_tf32_sets_both_matmul_and_cudnn(enabled: bool) -> None:
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = not enabled
        precision.set_tf32(enabled)
        assert torch.backends.cuda.matmul.allow_tf32 is enabled
        assert torch.backends.cudnn.allow_tf32 is enabled
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def test_tf32_is_off_unless_asked_for(monkeypatch: pytest.MonkeyPatch) -> None:
    from halfserve.settings import Settings

    assert Settings().tf32 is False
    monkeypatch.setenv("HALFSERVE_TF32", "1")
    assert Settings().tf32 is True
