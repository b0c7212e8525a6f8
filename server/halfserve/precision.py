"""Precision policy, shared by serving and training.

Everything that decides a dtype lives here: the mode names, what ``auto`` means on a device, how a model and its
inputs are cast, the autocast context and the GradScaler factory.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from halfserve.manifest import Precision  # the policy names, torch-free; the dtypes are here

_WEIGHT_DTYPES: dict[Precision, torch.dtype] = {
    Precision.FP16: torch.float16,
    Precision.BF16: torch.bfloat16,
    Precision.AUTOCAST: torch.float32,
    Precision.FP32: torch.float32,
}

DTYPE_NAMES: dict[str, torch.dtype] = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def cpu_has_native_bf16() -> bool:
    """True when this CPU computes bf16 in hardware (AVX512-BF16 / AMX), where bf16 beats fp32."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def resolve(precision: Precision | str, device: torch.device) -> Precision:
    """Turn ``auto`` into a concrete mode for ``device``; concrete modes pass through.

    fp16 on a CPU without fp16 units runs 3-20x slower than fp32 (measured), so ``auto`` never picks it there.
    """
    precision = Precision(precision)
    if precision is not Precision.AUTO:
        return precision
    if device.type == "cuda":
        return Precision.FP16
    return Precision.BF16 if cpu_has_native_bf16() else Precision.FP32


def set_tf32(enabled: bool) -> None:
    """Allow or forbid TF32 for fp32 matmuls and cuDNN convolutions/RNNs (Ampere and newer GPUs; no effect elsewhere).

    torch's defaults differ per library (matmul: off; cuDNN: on), so fp32 on an A10 would be partly TF32 unless set.
    The ``allow_tf32`` flags are used because torch 2.3 knows only them; mixing them with the newer
    ``fp32_precision`` API makes torch's own getters raise.
    """
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled


def weight_dtype(precision: Precision) -> torch.dtype:
    """The dtype the model's parameters are stored in when serving under ``precision`` (a resolved mode)."""
    return _WEIGHT_DTYPES[Precision(precision)]


def autocast_dtype(device: torch.device) -> torch.dtype:
    """The lower precision autocast runs in on ``device``: fp16 on CUDA, bf16 elsewhere."""
    return torch.float16 if device.type == "cuda" else torch.bfloat16


def prepare_model(model: nn.Module, precision: Precision, device: torch.device) -> nn.Module:
    """Move ``model`` to ``device`` and cast it once for serving; returns it in eval mode.

    Casting once matters: autocast under inference_mode re-casts every weight on every forward.
    """
    return model.to(device=device, dtype=weight_dtype(precision)).eval()


def cast_input(x: torch.Tensor, precision: Precision) -> torch.Tensor:
    """Cast a floating input to the dtype the model's weights are in (autocast inputs stay fp32)."""
    if not x.is_floating_point():
        return x
    return x.to(weight_dtype(precision))


def forward_context(precision: Precision, device: torch.device) -> contextlib.AbstractContextManager[None]:
    """The context a serving forward runs under: autocast for ``autocast`` mode, nothing otherwise."""
    if Precision(precision) is Precision.AUTOCAST:
        return torch.autocast(device.type, dtype=autocast_dtype(device))
    return contextlib.nullcontext()


@contextlib.contextmanager
def inference(precision: Precision, device: torch.device) -> Iterator[None]:
    """``torch.inference_mode`` plus the forward context of ``precision``."""
    with torch.inference_mode(), forward_context(precision, device):
        yield


# Training -------------------------------------------------------------------------------------------------------


def training_autocast(dtype: torch.dtype, device: torch.device) -> contextlib.AbstractContextManager[None]:
    """Autocast for a training forward in ``dtype``; fp32 means autocast is off."""
    return torch.autocast(device.type, dtype=dtype, enabled=dtype is not torch.float32)


def grad_scaler(dtype: torch.dtype, device: torch.device) -> torch.amp.GradScaler:
    """A GradScaler that is live only for fp16, whose narrow exponent range needs loss scaling; bf16 does not."""
    return torch.amp.GradScaler(device.type, enabled=dtype is torch.float16)


def default_training_dtype(device: torch.device) -> torch.dtype:
    """fp16 on CUDA; bf16 on a CPU (fp16 autocast on a CPU without fp16 units is many times slower per step)."""
    return torch.float16 if device.type == "cuda" else torch.bfloat16


def default_device() -> torch.device:
    """CUDA when present, else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resolve_device(name: str) -> torch.device:
    """``auto`` picks CUDA when present; anything else is passed to ``torch.device`` and checked."""
    if name == "auto":
        return default_device()
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available")
    return device
