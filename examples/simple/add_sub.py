"""Triton's classic ``simple`` model, as a user's own code: two INT32 inputs of 16 values, their sum and difference.

Served with ``--code-path examples/simple``, which puts this folder on the import path so the manifest's
``"architecture": "add_sub:build"`` finds :func:`build`. The model has no weights; its ``model.safetensors`` holds none.
"""

from __future__ import annotations

import torch
from torch import nn


class AddSub(nn.Module):
    """``OUTPUT0 = INPUT0 + INPUT1`` and ``OUTPUT1 = INPUT0 - INPUT1``, in the inputs' own integer type."""

    def forward(self, INPUT0: torch.Tensor, INPUT1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: N803
        return INPUT0 + INPUT1, INPUT0 - INPUT1


def build() -> nn.Module:
    return AddSub()
