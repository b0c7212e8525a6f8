"""The precision policy: mode resolution, casting once, inputs, autocast and the GradScaler factory."""

from __future__ import annotations

import pytest
import torch

from halfserve import models, precision
from halfserve.manifest import Precision
from halfserve.precision import DeviceKind, DeviceType

CPU = torch.device("cpu")

# Made-up devices: the choice is a pure function of these properties, so no GPU is needed to test it.
T4 = DeviceKind(DeviceType.CUDA, "Tesla T4", (7, 5), native_bf16=False)
V100 = DeviceKind(DeviceType.CUDA, "Tesla V100-SXM2-16GB", (7, 0), native_bf16=False)
A10 = DeviceKind(DeviceType.CUDA, "NVIDIA A10", (8, 6), native_bf16=True)
H100 = DeviceKind(DeviceType.CUDA, "NVIDIA H100 80GB HBM3", (9, 0), native_bf16=True)
CPU_BF16 = DeviceKind(DeviceType.CPU, "cpu", None, native_bf16=True)
CPU_PLAIN = DeviceKind(DeviceType.CPU, "cpu", None, native_bf16=False)


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        (T4, Precision.FP16),
        (V100, Precision.FP16),
        (A10, Precision.FP16),
        (H100, Precision.FP16),
        (CPU_BF16, Precision.BF16),
        (CPU_PLAIN, Precision.FP32),
    ],
    ids=["t4", "v100", "a10", "h100", "cpu-bf16", "cpu-plain"],
)
def test_auto_picks_the_devices_native_half(kind: DeviceKind, expected: Precision) -> None:
    assert precision.resolve("auto", kind) is expected


def test_auto_on_this_cpu_follows_its_native_bf16() -> None:
    on_cpu = precision.resolve("auto", CPU)
    assert on_cpu is (Precision.BF16 if precision.cpu_has_native_bf16() else Precision.FP32)
    assert precision.resolve("fp16", CPU) is Precision.FP16  # an explicit choice is honoured
    assert precision.device_kind(CPU) == DeviceKind(DeviceType.CPU, "cpu", None, precision.cpu_has_native_bf16())


@pytest.mark.parametrize("kind", [T4, V100], ids=["t4", "v100"])
def test_explicit_bf16_on_a_gpu_without_native_bf16_is_served_with_a_warning(
    kind: DeviceKind, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level("WARNING", logger="halfserve.precision"):
        assert precision.resolve("bf16", kind) is Precision.BF16
    [record] = caplog.records
    assert "emulated" in record.getMessage()
    assert "fp16" in record.getMessage()
    assert kind.name in record.getMessage()


@pytest.mark.parametrize("kind", [A10, H100, CPU_BF16], ids=["a10", "h100", "cpu-bf16"])
def test_explicit_bf16_where_native_is_quiet(kind: DeviceKind, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING", logger="halfserve.precision"):
        assert precision.resolve("bf16", kind) is Precision.BF16
    assert not caplog.records


def test_autocast_and_training_follow_the_half_dtype() -> None:
    assert precision.half_dtype(DeviceType.CUDA) is torch.float16
    assert precision.half_dtype(DeviceType.CPU) is torch.bfloat16
    for device in (CPU, torch.device("cuda")):
        assert precision.autocast_dtype(device) is precision.half_dtype(device.type)
        assert precision.default_training_dtype(device) is precision.half_dtype(device.type)


def test_device_kind_is_recorded_as_plain_json() -> None:
    assert T4.as_dict() == {"type": "cuda", "name": "Tesla T4", "capability": "7.5", "native_bf16": False}
    assert CPU_BF16.as_dict()["capability"] is None


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
