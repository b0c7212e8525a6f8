"""How a model takes an engine's batches: its inputs' order (:func:`takes_positionally`), the manifest's
normalisation (:class:`Normalizer`), and whether it has convolutions to run channels-last (:func:`has_conv2d`)."""

from __future__ import annotations

import inspect

import torch
from torch import nn

from halfserve.engine.protocol import EngineError
from halfserve.manifest import Normalize


def takes_positionally(module: nn.Module, names: list[str]) -> bool:
    """How ``module``'s forward takes a model's inputs: by keyword (False) when it has parameters of those names (or
    ``**kwargs``), in the manifest's order (True) when it takes ``*args`` instead. Anything else cannot take them."""
    try:
        params = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):  # a forward without a signature to read (a builtin): trust the manifest's order
        return True
    named = [n for n in names if n in params and params[n].kind is not inspect.Parameter.POSITIONAL_ONLY]
    if len(named) == len(names):
        return False
    kinds = {p.kind for p in params.values()}
    if inspect.Parameter.VAR_POSITIONAL in kinds and not named:
        return True
    if inspect.Parameter.VAR_KEYWORD in kinds:
        return False
    missing = [n for n in names if n not in named]
    raise EngineError(
        f"inputs: forward({', '.join(params)}) has no parameter named {missing[0]!r}; with several inputs, forward "
        "takes them by keyword, named as in the manifest (or all positionally through *args)"
    )


def has_conv2d(module: nn.Module) -> bool:
    return any(isinstance(m, nn.Conv2d) for m in module.modules())


class Normalizer:
    """A manifest's :class:`~halfserve.manifest.Normalize` on one device: ``(x * scale - mean) / std`` in fp32, per
    channel.

    Folded into one multiply-add, ``x * (scale / std) - mean / std``, run by one ``addcmul`` that also widens the
    input: one pass over the batch instead of four (``docs/benchmarks.md``), and one kernel launch on a GPU. fp32
    whatever the serving precision: the cast to it follows, as it would after a client's own normalisation.
    """

    def __init__(self, spec: Normalize, sample_ndim: int, device: torch.device) -> None:
        per_channel = (1, -1, *([1] * (sample_ndim - 1)))
        std = torch.tensor(spec.std if spec.std is not None else [1.0], dtype=torch.float64)
        mean = torch.tensor(spec.mean if spec.mean is not None else [0.0], dtype=torch.float64)
        # Folded in float64, rounded once to fp32.
        self.scale = (spec.scale / std).to(torch.float32).reshape(per_channel).to(device)
        self.shift = (-mean / std).to(torch.float32).reshape(per_channel).to(device)

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        return torch.addcmul(self.shift, t, self.scale)
