"""Precision policy, shared by serving and training.

Everything that decides a dtype lives here: the mode names, what ``auto`` means on a device, how a model and its
inputs are cast, the autocast context and the GradScaler factory.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from halfserve.manifest import Precision  # the policy names, torch-free; the dtypes are here

_WEIGHT_DTYPES: dict[Precision, torch.dtype] = {
    Precision.FP16: torch.float16,
    Precision.BF16: torch.bfloat16,
    Precision.AUTOCAST: torch.float32,
    Precision.FP32: torch.float32,
}

DTYPE_NAMES: dict[str, torch.dtype] = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}

# bf16 tensor cores arrived with Ampere (sm_80); below it torch.cuda.is_bf16_supported() still says True because
# bf16 is emulated through fp32, which is slower than fp16 and no more accurate than fp32 would be.
NATIVE_BF16_CAPABILITY = (8, 0)

log = logging.getLogger(__name__)


class DeviceType(StrEnum):
    """The kinds of device a model is served on."""

    CPU = "cpu"
    CUDA = "cuda"


def cpu_has_native_bf16() -> bool:
    """True when this CPU computes bf16 in hardware (AVX512-BF16 / AMX), where bf16 beats fp32."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


@dataclass(frozen=True)
class DeviceKind:
    """What the precision policy needs to know of a device: every dtype choice is a pure function of this.

    ``capability`` is the CUDA compute capability (``None`` on a CPU); ``native_bf16`` says whether bf16 runs in
    hardware (a CPU's AVX512-BF16/AMX, a GPU's sm_80+ tensor cores) rather than emulated.
    """

    type: DeviceType
    name: str
    capability: tuple[int, int] | None = None
    native_bf16: bool = False

    def as_dict(self) -> dict[str, object]:
        capability = None if self.capability is None else f"{self.capability[0]}.{self.capability[1]}"
        return {"type": self.type.value, "name": self.name, "capability": capability, "native_bf16": self.native_bf16}


def device_kind(device: torch.device) -> DeviceKind:
    """The :class:`DeviceKind` of a real ``device`` (the one place that asks torch about the hardware)."""
    if device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        native = capability >= NATIVE_BF16_CAPABILITY
        return DeviceKind(DeviceType.CUDA, torch.cuda.get_device_name(device), capability, native)
    if device.type == "cpu":
        return DeviceKind(DeviceType.CPU, "cpu", None, cpu_has_native_bf16())
    raise ValueError(f"device type {device.type!r} is not supported; use cpu or cuda")


def half_dtype(device_type: DeviceType | str) -> torch.dtype:
    """The half dtype this device computes fast: fp16 on every GPU, bf16 on a CPU.

    On a GPU of compute capability 8.0 or newer fp16 and bf16 run at the same tensor-core rate and fp16 keeps 3 more
    mantissa bits, so fp16 stays; below 8.0 bf16 is emulated. A CPU has no fp16 units (3-20x slower than fp32,
    measured) but bf16 is native with AVX512-BF16/AMX.
    """
    return torch.float16 if DeviceType(device_type) is DeviceType.CUDA else torch.bfloat16


def resolve(precision: Precision | str, device: torch.device | DeviceKind) -> Precision:
    """Turn ``auto`` into a concrete mode for ``device``; concrete modes pass through.

    ``auto`` is the device's half dtype where it runs natively, else fp32 (a CPU without native bf16). An explicit
    ``bf16`` on a GPU without native bf16 is served as asked, with a warning that it is emulated there.
    """
    kind = device if isinstance(device, DeviceKind) else device_kind(device)
    precision = Precision(precision)
    if precision is Precision.BF16 and kind.type is DeviceType.CUDA and not kind.native_bf16:
        log.warning(
            "bf16 on %s (compute capability %s) is emulated, slower than fp16 and no more accurate; "
            "use precision fp16 (or auto) there",
            kind.name,
            kind.as_dict()["capability"],
        )
    if precision is not Precision.AUTO:
        return precision
    half = half_dtype(kind.type)
    if half is torch.bfloat16 and not kind.native_bf16:
        return Precision.FP32
    return Precision.FP16 if half is torch.float16 else Precision.BF16


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
    """The lower precision autocast runs in on ``device``: its :func:`half_dtype` (asked per forward, so cheap)."""
    return half_dtype(device.type)


def prepare_model(model: nn.Module, precision: Precision, device: torch.device) -> nn.Module:
    """Move ``model`` to ``device`` and cast it once for serving; returns it in eval mode.

    Casting once matters: autocast under inference_mode re-casts every weight on every forward.
    """
    return model.to(device=device, dtype=weight_dtype(precision)).eval()


def cast_floating(value: Any, dtype: torch.dtype) -> Any:
    """``value`` with every floating tensor in it (nested in tuples, lists, dicts) cast to ``dtype``."""
    return pytree.tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, value)


def keep_fp32(model: nn.Module, names: Sequence[str], half: torch.dtype, weights: nn.Module) -> None:
    """Keep the modules ``names`` of ``model`` (already cast to ``half``) in fp32, a mixed-precision plan
    (:mod:`halfserve.mixed`): their weights and computation are fp32 and their floating inputs are cast up on the way
    in, so the model is to be given its inputs in fp32 (the engine does): rounded to ``half`` first, a kept module
    that reads them would compute in fp32 on half-precision values. Their outputs stay fp32, so a plan that keeps the
    last projection in fp32 answers with its fp32 scores (cast down, scores that differ by less than ``half``
    resolves would tie again); every other module holding parameters casts its floating inputs to ``half`` on the
    way in, so each boundary gives the module after it its own dtype.
    The kept modules' weights are copied from ``weights`` (the host's fp32 model): cast up from ``half``, they would
    have lost what the plan keeps them for."""

    def cast_to(dtype: torch.dtype) -> Callable[[nn.Module, Any, Any], tuple[Any, Any]]:
        def hook(_module: nn.Module, args: Any, kwargs: Any) -> tuple[Any, Any]:
            return cast_floating(args, dtype), cast_floating(kwargs, dtype)

        return hook

    kept = [model.get_submodule(name) for name in names]
    inside = {id(m) for k in kept for m in k.modules()}
    for name, module in zip(names, kept, strict=True):
        module.float()
        module.load_state_dict(weights.get_submodule(name).state_dict())
        module.register_forward_pre_hook(cast_to(torch.float32), with_kwargs=True)
    for module in model.modules():
        if id(module) not in inside and any(True for _ in module.parameters(recurse=False)):
            module.register_forward_pre_hook(cast_to(half), with_kwargs=True)


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
    """The device's :func:`half_dtype` (fp16 autocast on a CPU without fp16 units is many times slower per step)."""
    return half_dtype(device.type)


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
