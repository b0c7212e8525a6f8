"""Small convolutional classifier for single-channel images (8x8 digits and up)."""

from __future__ import annotations

import torch
from torch import nn

from halfserve.models.registry import register


@register("small_cnn")
class SmallCNN(nn.Module):
    """Two conv blocks, global average pooling, a linear head. Works on any image size >= 4x4."""

    def __init__(self, in_channels: int = 1, num_classes: int = 10, width: int = 32) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, padding=1),
            nn.BatchNorm2d(width),
            nn.ReLU(),
            nn.Conv2d(width, width * 2, 3, padding=1),
            nn.BatchNorm2d(width * 2),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(width * 2, width * 4, 3, padding=1),
            nn.BatchNorm2d(width * 4),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
        )
        self.head = nn.Linear(width * 4, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.head(self.features(x).flatten(1))
        return y
