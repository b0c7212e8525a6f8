"""Multi-layer perceptron for flat feature vectors."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from halfserve.models.registry import register


@register("mlp")
class MLP(nn.Module):
    """``in_features -> hidden... -> out_features`` with ReLU between layers."""

    def __init__(self, in_features: int, hidden: Sequence[int], out_features: int, dropout: float = 0.0) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        width = in_features
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            if dropout:
                layers.append(nn.Dropout(dropout))
            width = h
        layers.append(nn.Linear(width, out_features))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.net(x.flatten(1))
        return y
