"""Evaluate a trained checkpoint the way the server will run it: fp32, fp16 and bf16.

The model is read back through :func:`halfserve.store.load` (so the saved file, not the in-memory training model, is
what is measured) and cast once per precision with :func:`halfserve.precision.prepare_model`, exactly as an engine
does. Half precision is judged two ways: accuracy against the labels, and top-1 agreement with the fp32 model, which
isolates what the cast itself changes.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from halfserve import store
from halfserve.fidelity import top1_agrees
from halfserve.manifest import Precision
from halfserve.precision import cast_input, inference, prepare_model

SERVED_PRECISIONS = (Precision.FP32, Precision.FP16, Precision.BF16)


@dataclass(frozen=True)
class Evaluation:
    """Test-split results of one checkpoint."""

    test_samples: int
    accuracy: dict[str, float]
    """Accuracy per serving precision name (``fp32``, ``fp16``, ``bf16``)."""
    agreement: dict[str, float]
    """Fraction of test samples whose top-1 class matches fp32's, per half precision."""
    max_abs_logit_diff: dict[str, float]
    """Largest absolute logit difference from fp32, per half precision (``inf`` if any logit overflowed)."""
    device: str

    def as_dict(self) -> dict[str, Any]:
        """The manifest's ``evaluation`` entry: flat keys such as ``fp16_accuracy`` and ``bf16_top1_agreement``."""
        out: dict[str, Any] = {"test_samples": self.test_samples, "device": self.device}
        for name, value in self.accuracy.items():
            out[f"{name}_accuracy"] = round(value, 6)
        for name, value in self.agreement.items():
            out[f"{name}_top1_agreement"] = round(value, 6)
        for name, value in self.max_abs_logit_diff.items():
            out[f"{name}_max_abs_logit_diff"] = round(value, 6) if math.isfinite(value) else None
        return out


def logits(
    module: nn.Module, x: torch.Tensor, precision: Precision, device: torch.device, batch_size: int = 256
) -> torch.Tensor:
    """fp32 logits of a copy of ``module`` served under ``precision`` on ``device`` (``module`` is left as it is)."""
    model = prepare_model(copy.deepcopy(module), precision, device)
    chunks = []
    with inference(precision, device):
        for start in range(0, x.shape[0], batch_size):
            batch = cast_input(x[start : start + batch_size].to(device), precision)
            chunks.append(model(batch).float().cpu())
    return torch.cat(chunks)


def evaluate_module(module: nn.Module, x: torch.Tensor, y: torch.Tensor, device: torch.device) -> Evaluation:
    """Accuracy and fp32 agreement of ``module`` on ``(x, y)`` under every serving precision."""
    outputs = {str(p): logits(module, x, p, device) for p in SERVED_PRECISIONS}
    reference = outputs[str(Precision.FP32)]
    top1 = {name: out.argmax(dim=1) for name, out in outputs.items()}
    halves = [name for name in outputs if name != str(Precision.FP32)]
    want = reference.double().numpy()
    return Evaluation(
        test_samples=int(x.shape[0]),
        accuracy={name: _fraction(pred == y) for name, pred in top1.items()},
        # As the fidelity check counts it: a half-precision row of NaNs does not agree with fp32's first class.
        agreement={
            name: _fraction(torch.from_numpy(top1_agrees(want, outputs[name].double().numpy()))) for name in halves
        },
        max_abs_logit_diff={name: _max_abs_diff(outputs[name], reference) for name in halves},
        device=str(device),
    )


def evaluate(root: Path, name: str, version: int, x: torch.Tensor, y: torch.Tensor, device: torch.device) -> Evaluation:
    """Load version ``version`` of model ``name`` from the store at ``root`` and evaluate it on ``(x, y)``."""
    loaded = store.load(root, name, version)
    return evaluate_module(loaded.module, x, y, device)


def _max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    diff = float((a - b).abs().max()) if a.numel() else 0.0
    # NaN (an overflowed logit minus anything) reads as unbounded, not as "no difference".
    return diff if math.isfinite(diff) else math.inf


def _fraction(mask: torch.Tensor) -> float:
    return float(mask.float().mean().item()) if mask.numel() else 0.0
