"""Models and wrappers that misbehave on purpose, saved through the real store code or wrapped around a real engine."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from halfserve import models, store
from halfserve.execution import Batching
from halfserve.manifest import Manifest, OverflowPolicy, TensorSpec

OVERFLOW_WEIGHT = 200.0
"""Output 0 is ``200 * sum(x)``: past fp16's 65504 once the four inputs sum past 327.68, finite in fp32 and bf16."""


def save_overflowing_linear(root: Path, name: str, overflow: OverflowPolicy, **manifest_fields: object) -> Path:
    """A single Linear(4 -> 2) through the registered ``mlp`` architecture, with weights that overflow fp16 for
    large inputs: output 0 is ``200 * sum(x)``, output 1 is ``0.001 * sum(x)``."""
    kwargs = {"in_features": 4, "hidden": [], "out_features": 2}
    module = models.build("mlp", **kwargs)
    with torch.no_grad():
        linear = module.net[0]
        linear.weight.copy_(torch.tensor([[OVERFLOW_WEIGHT] * 4, [0.001] * 4]))
        linear.bias.zero_()
    fields: dict[str, object] = {
        "name": name,
        "architecture": "mlp",
        "arch_kwargs": kwargs,
        "inputs": [TensorSpec(name="x", shape=[4])],
        "outputs": [TensorSpec(name="y", shape=[2])],
        "precision": "fp16",
        "overflow": overflow,
        "batching": Batching(max_batch_size=8, max_delay_ms=2),
    }
    fields.update(manifest_fields)
    return store.save(root, Manifest.model_validate(fields), module)


class Poisonable(nn.Module):
    """Wraps a model: raises for a batch holding the value ``poison``, and torch's out-of-memory error for a batch of
    more than ``oom_above`` rows; records the row count of every forward."""

    def __init__(self, inner: nn.Module, poison: float = 666.0, oom_above: int | None = None) -> None:
        super().__init__()
        self.inner = inner
        self.poison = poison
        self.oom_above = oom_above
        self.sizes: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.sizes.append(int(x.shape[0]))
        if self.oom_above is not None and x.shape[0] > self.oom_above:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {x.shape[0]} rows' worth")
        if (x == self.poison).any():
            raise ValueError(f"poisoned input ({self.poison})")
        y: torch.Tensor = self.inner(x)
        return y
