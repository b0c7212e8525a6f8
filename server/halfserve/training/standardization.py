"""Feature standardization that trains as a separate layer and ships folded into the model's first Linear.

Clients send raw features; the served ``mlp`` must therefore compute ``W (x - mean) / std + b``. That is itself a
linear map, ``(W / std) x + (b - W (mean / std))``, so after training the statistics are folded into the first
layer's weight and bias and the saved checkpoint is a plain registered architecture with nothing extra to serve.
"""

from __future__ import annotations

import torch
from torch import nn


class Standardize(nn.Module):
    """``(x - mean) / std`` with fixed statistics (buffers, never trained)."""

    mean: torch.Tensor
    std: torch.Tensor

    def __init__(self, mean: torch.Tensor, std: torch.Tensor) -> None:
        super().__init__()
        if mean.shape != std.shape or mean.dim() != 1:
            raise ValueError(
                f"mean and std must be vectors of one length, got {list(mean.shape)} and {list(std.shape)}"
            )
        self.register_buffer("mean", mean.detach().float().clone())
        self.register_buffer("std", std.detach().float().clone())

    @classmethod
    def fit(cls, x: torch.Tensor) -> Standardize:
        """Statistics of the training features ``x`` (``[N, F]``); constant columns get std 1 instead of 0."""
        std = x.double().std(dim=0, unbiased=False)
        std = torch.where(std > 0, std, torch.ones_like(std))
        return cls(x.double().mean(dim=0), std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.mean) / self.std


def first_linear(model: nn.Module) -> nn.Linear:
    """The first ``nn.Linear`` in ``model``'s module order: the layer raw features meet."""
    for module in model.modules():
        if isinstance(module, nn.Linear):
            return module
    raise ValueError(f"{type(model).__name__} has no nn.Linear layer to fold standardization into")


@torch.no_grad()
def fold(standardize: Standardize, model: nn.Module) -> nn.Module:
    """Fold ``standardize`` into ``model``'s first Linear, in place; ``model`` then takes raw features.

    Computed in float64 so the folded layer matches the two-step computation to fp32 rounding.
    """
    layer, bias = _layer(model, standardize)
    weight = layer.weight.double()
    inv_std = 1.0 / standardize.std.double()
    bias.copy_(bias.double() - weight @ (standardize.mean.double() * inv_std))
    layer.weight.copy_(weight * inv_std)
    return model


@torch.no_grad()
def unfold(standardize: Standardize, model: nn.Module) -> nn.Module:
    """Undo :func:`fold`, in place: ``model`` takes standardized features again (used when training resumes)."""
    layer, bias = _layer(model, standardize)
    weight = layer.weight.double() * standardize.std.double()
    bias.copy_(bias.double() + weight @ (standardize.mean.double() / standardize.std.double()))
    layer.weight.copy_(weight)
    return model


def _layer(model: nn.Module, standardize: Standardize) -> tuple[nn.Linear, torch.Tensor]:
    layer = first_linear(model)
    if layer.in_features != standardize.mean.numel():
        raise ValueError(
            f"first Linear takes {layer.in_features} features but the statistics cover {standardize.mean.numel()}"
        )
    # The mean's contribution has to land in a bias; a bias-free layer has nowhere to put it.
    if layer.bias is None:
        raise ValueError("the first Linear has no bias to fold the mean into")
    return layer, layer.bias
