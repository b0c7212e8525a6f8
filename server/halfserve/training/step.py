"""One mixed-precision optimizer step, in the order that keeps loss scaling correct.

The order follows nanoGPT's ``train.py``:

1. forward and loss under autocast (fp16 or bf16; fp32 turns autocast off);
2. ``scaler.scale(loss).backward()``: fp16 gradients are computed on a scaled loss so small ones do not flush to zero;
3. ``scaler.unscale_(optimizer)`` *before* clipping, so the clip threshold applies to the true gradient norm, not the
   scaled one, and infs/NaNs are detected here;
4. ``clip_grad_norm_``;
5. ``scaler.step(optimizer)``: skips the update when step 3 found a non-finite gradient;
6. ``scaler.update()``: halves the scale after a skipped step, grows it after ``growth_interval`` clean ones;
7. ``optimizer.zero_grad(set_to_none=True)``: frees the gradient memory instead of writing zeros.

With bf16 or fp32 the scaler is disabled (bf16 has fp32's exponent range) and steps 2, 3, 5 and 6 reduce to plain
``backward()`` / ``step()``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from halfserve.precision import training_autocast


@dataclass(frozen=True)
class StepResult:
    """What one step did."""

    loss: float
    """Mean cross-entropy of the batch, as computed in the forward (unscaled)."""
    loss_scale: float
    """The scale the loss was multiplied by for this step's backward (1.0 when the scaler is disabled)."""
    skipped: bool
    """True when the scaler found a non-finite gradient and left the parameters unchanged."""
    grad_norm: float
    """Total gradient norm before clipping (after unscaling); ``inf``/``nan`` on a skipped step."""
    correct: int
    """How many of the batch's samples the forward classified correctly (for running train accuracy)."""


def train_step(
    model: nn.Module,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    *,
    dtype: torch.dtype,
    device: torch.device,
    max_grad_norm: float = 1.0,
) -> StepResult:
    """Run one training step of ``model`` on a batch; ``inputs`` and ``targets`` must already be on ``device``.

    ``max_grad_norm`` of ``inf`` measures the gradient norm without clipping.
    """
    enabled = scaler.is_enabled()
    # get_scale() reads the scale tensor back to the host: a device sync, once before and once after the step.
    scale_before = scaler.get_scale() if enabled else 1.0

    with training_autocast(dtype, device):
        logits = model(inputs)
        # Softmax over half-precision logits loses precision; the loss is reduced in fp32.
        loss = F.cross_entropy(logits.float(), targets)

    scaler.scale(loss).backward()  # type: ignore[no-untyped-call]  # Tensor.backward has no annotations
    scaler.unscale_(optimizer)
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)

    # The scale only ever shrinks on a step where unscale_ found an inf or NaN, and that step is skipped.
    skipped = enabled and scaler.get_scale() < scale_before
    correct = int((logits.detach().argmax(dim=1) == targets).sum().item())
    return StepResult(
        loss=float(loss.detach().item()),
        loss_scale=float(scale_before),
        skipped=skipped,
        grad_norm=float(grad_norm.item()),
        correct=correct,
    )


def cosine_lr(base: float, step: int, total: int, floor: float = 0.1) -> float:
    """The rate for 0-based ``step`` of ``total``: cosine from ``base`` down to ``floor * base`` at the last step."""
    progress = step / max(total - 1, 1)
    return base * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))
