"""A team's own model, in its own file outside halfserve: a small classifier of 8x8 digit images (64 pixel values).

The manifest names it ``"architecture": "digits_net:build"``; ``--code-path examples/own_model`` puts this folder on
the server's import path. Only this code is imported: the weights come from ``model.safetensors``.
"""

from __future__ import annotations

import torch
from torch import nn


class DigitsNet(nn.Module):
    def __init__(self, hidden: int = 64, classes: int = 10) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU())
        self.head = nn.Linear(hidden, classes)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(pixels / 16.0))  # pixel values run 0..16


def build(hidden: int = 64, classes: int = 10) -> nn.Module:
    return DigitsNet(hidden, classes)
