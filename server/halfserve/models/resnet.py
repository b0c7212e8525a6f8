"""A CIFAR-style ResNet for throughput tests: a model whose forward costs real compute, at any width and depth.

The shipped ``model_store/resnet_bench`` is ResNet-20 (three stages of three BasicBlocks, width 32, 3x32x32
images) with random weights; ``python -m halfserve.loadtest.make_bench_model`` regenerates it, or a wider, deeper or
larger-image variant for a GPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from torch import nn

from halfserve.models.registry import register

BlockKind = Literal["basic", "bottleneck"]
StemKind = Literal["cifar", "imagenet"]


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with BatchNorm and an identity (or 1x1 projection) shortcut."""

    expansion = 1

    def __init__(self, in_channels: int, channels: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, channels, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.relu = nn.ReLU(inplace=True)
        self.shortcut = _shortcut(in_channels, channels, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        out: torch.Tensor = self.relu(y + self.shortcut(x))
        return out


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3, 1x1 expand (x4), each with BatchNorm, and a shortcut."""

    expansion = 4

    def __init__(self, in_channels: int, channels: int, stride: int) -> None:
        super().__init__()
        out_channels = channels * self.expansion
        self.conv1 = nn.Conv2d(in_channels, channels, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.conv3 = nn.Conv2d(channels, out_channels, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_channels)
        self.relu = nn.ReLU(inplace=True)
        self.shortcut = _shortcut(in_channels, out_channels, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.relu(self.bn1(self.conv1(x)))
        y = self.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        out: torch.Tensor = self.relu(y + self.shortcut(x))
        return out


def _shortcut(in_channels: int, out_channels: int, stride: int) -> nn.Module:
    if stride == 1 and in_channels == out_channels:
        return nn.Identity()
    return nn.Sequential(
        nn.Conv2d(in_channels, out_channels, 1, stride, bias=False),
        nn.BatchNorm2d(out_channels),
    )


@register("resnet_bench")
class ResNetBench(nn.Module):
    """CIFAR-style ResNet: a 3x3 stem, stages of residual blocks (channels doubling and resolution halving from the
    second stage on), global average pooling and a linear head. Works on any image size >= 4x4.

    ``blocks`` gives the number of blocks per stage: ``[3, 3, 3]`` with ``block="basic"`` is ResNet-20, ``[9, 9, 9]``
    ResNet-56. ``stem="imagenet"`` is torchvision's stem (7x7 stride-2 convolution and 3x3 stride-2 max pooling):
    with width 64, bottleneck blocks ``[3, 4, 6, 3]`` and 224x224 images it is ResNet-50 (see :func:`resnet50`).
    ``channels_last`` keeps the conv weights (and converts the input) to NHWC, which oneDNN and cuDNN run faster.
    Measured through the engine on a 2-core AVX-512/AMX CPU (ResNet-20, width 32, medians of 9 forwards): bf16 batch
    8 in 5.1 ms instead of 7.3 ms and batch 32 in 17.5 ms instead of 25 ms; fp32 batch 8 in 11.5 ms instead of 12.7 ms
    and batch 32 in 54 ms instead of 60 ms.
    """

    def __init__(
        self,
        in_channels: int = 3,
        num_classes: int = 10,
        width: int = 16,
        blocks: Sequence[int] = (3, 3, 3),
        block: BlockKind = "basic",
        channels_last: bool = True,
        stem: StemKind = "cifar",
    ) -> None:
        super().__init__()
        if not blocks or any(n < 1 for n in blocks):
            raise ValueError(f"blocks: expected at least one stage of at least one block, got {list(blocks)}")
        if width < 1:
            raise ValueError(f"width: expected a positive channel count, got {width}")
        kind: type[BasicBlock | Bottleneck]
        if block == "basic":
            kind = BasicBlock
        elif block == "bottleneck":
            kind = Bottleneck
        else:
            raise ValueError(f"block: expected 'basic' or 'bottleneck', got {block!r}")
        self.channels_last = channels_last
        if stem == "cifar":
            stem_layers: list[nn.Module] = [nn.Conv2d(in_channels, width, 3, 1, 1, bias=False)]
        elif stem == "imagenet":
            stem_layers = [nn.Conv2d(in_channels, width, 7, 2, 3, bias=False)]
        else:
            raise ValueError(f"stem: expected 'cifar' or 'imagenet', got {stem!r}")
        stem_layers += [nn.BatchNorm2d(width), nn.ReLU(inplace=True)]
        if stem == "imagenet":
            stem_layers.append(nn.MaxPool2d(3, 2, 1))
        self.stem = nn.Sequential(*stem_layers)
        layers: list[nn.Module] = []
        channels_in = width
        for stage, count in enumerate(blocks):
            channels = width * 2**stage
            for i in range(count):
                stride = 2 if stage > 0 and i == 0 else 1
                layers.append(kind(channels_in, channels, stride))
                channels_in = channels * kind.expansion
        self.stages = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(channels_in, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
                if channels_last:
                    # Module.to(dtype/device) and load_state_dict keep a parameter's strides, so this layout
                    # survives loading from the store and the engine's cast.
                    m.weight.data = m.weight.data.contiguous(memory_format=torch.channels_last)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        y: torch.Tensor = self.head(self.pool(self.stages(self.stem(x))).flatten(1))
        return y


@register("resnet50")
def resnet50(num_classes: int = 1000, in_channels: int = 3, channels_last: bool = True) -> ResNetBench:
    """ResNet-50 (v1.5: the stride sits on the 3x3 convolution), layer for layer as torchvision builds it: 25.6 M
    parameters at 1000 classes, about 4.1 GFLOPs per 224x224 image. Built here so that no torchvision is needed and
    nothing is downloaded; weights come from the store (random ones for throughput tests)."""
    return ResNetBench(
        in_channels=in_channels,
        num_classes=num_classes,
        width=64,
        blocks=(3, 4, 6, 3),
        block="bottleneck",
        channels_last=channels_last,
        stem="imagenet",
    )
