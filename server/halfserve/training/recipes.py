"""Training recipes: which bundled dataset, which registered architecture, and the hyperparameters that reach the
accuracy targets on a CPU in seconds to a minute.

A recipe's name is the served model's name. Architectures come from :mod:`halfserve.models`, so what is trained here is
exactly what the server builds from the manifest.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from torch import nn

from halfserve import models
from halfserve.execution import Batching
from halfserve.manifest import DataType, Manifest, Precision, TensorSpec
from halfserve.training import datasets
from halfserve.training.datasets import Dataset
from halfserve.training.errors import UnknownRecipeError
from halfserve.training.standardization import Standardize


@dataclass(frozen=True)
class Recipe:
    """How to train one servable model."""

    name: str
    description: str
    load_data: Callable[[], Dataset]
    architecture: str
    arch_kwargs: Mapping[str, Any]
    input_name: str
    epochs: int
    batch_size: int
    lr: float
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    standardize: bool = False
    """Train on standardized features and fold the statistics into the first Linear at export (see
    :mod:`halfserve.training.standardization`), so the served model takes raw features."""
    batching: Batching = field(default_factory=lambda: Batching(max_batch_size=64, max_delay_ms=2.0))
    inputs: tuple[TensorSpec, ...] | None = None
    """The served inputs, when they are not one input of the data's sample shape (sequences and their masks)."""

    def build(self) -> nn.Module:
        """A freshly initialised model of the recipe's architecture."""
        return models.build(self.architecture, **dict(self.arch_kwargs))

    def preprocessor(self, data: Dataset) -> Standardize | None:
        """The fixed layer the training model puts in front of the architecture, if any (fitted on train data)."""
        return Standardize.fit(data.x_train) if self.standardize else None

    def manifest(self, data: Dataset, **extra: Any) -> Manifest:
        """The served model's manifest; ``extra`` fills ``training`` / ``evaluation``."""
        return Manifest(
            name=self.name,
            architecture=self.architecture,
            arch_kwargs=_plain(self.arch_kwargs),
            inputs=list(self.inputs or [TensorSpec(name=self.input_name, shape=data.sample_shape)]),
            outputs=[TensorSpec(name="logits", shape=[data.num_classes])],
            labels=list(data.labels),
            precision=Precision.AUTO,
            batching=self.batching,
            description=self.description,
            dataset=data.describe(),
            **extra,
        )


def _plain(value: Any) -> Any:
    """Mappings and tuples as the JSON types a manifest round-trips to (so the written and read manifest compare)."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    return value


def _frozen(**kwargs: Any) -> Mapping[str, Any]:
    return MappingProxyType(kwargs)


RECIPES: Mapping[str, Recipe] = MappingProxyType(
    {
        r.name: r
        for r in (
            Recipe(
                name="digits_cnn",
                description=(
                    "Handwritten digit classifier (small_cnn) for 8x8 grey images: send [1, 8, 8] pixel values "
                    "scaled to 0..1 (sklearn load_digits values / 16); returns 10 logits for labels '0'..'9'."
                ),
                load_data=datasets.digits_8x8,
                architecture="small_cnn",
                arch_kwargs=_frozen(in_channels=1, num_classes=10, width=32),
                input_name="image",
                epochs=12,
                batch_size=32,
                lr=3e-3,
                weight_decay=1e-4,
            ),
            Recipe(
                name="digits_mlp",
                description=(
                    "Handwritten digit classifier (mlp 256-1024-1024-10, the benchmark shape): send 256 pixel values "
                    "0..1 of a 16x16 image (8x8 digits / 16, bilinearly upsampled); returns 10 logits."
                ),
                load_data=datasets.digits_16x16_flat,
                architecture="mlp",
                arch_kwargs=_frozen(in_features=256, hidden=(1024, 1024), out_features=10, dropout=0.0),
                input_name="pixels",
                epochs=20,
                batch_size=64,
                lr=2e-3,
                weight_decay=1e-4,
            ),
            Recipe(
                name="digits_transformer",
                description=(
                    "Handwritten digit classifier (transformer_classifier, 2 layers, width 64) over a variable-length "
                    "token sequence: each 8x8 image read row by row, pixel value v as token v + 1, 48..64 tokens "
                    "(the first 6..8 rows); the server batches lengths together and builds the attention mask."
                ),
                load_data=datasets.digits_sequence,
                architecture="transformer_classifier",
                arch_kwargs=_frozen(vocab=18, classes=10, dim=64, heads=4, layers=2, hidden=128, max_length=64),
                input_name="tokens",
                epochs=20,
                batch_size=32,
                lr=1e-3,
                weight_decay=0.05,
                inputs=(
                    TensorSpec(name="tokens", datatype=DataType.INT64, shape=[-1], max_length=64),
                    TensorSpec(name="mask", datatype=DataType.INT64, shape=[-1], mask_for="tokens"),
                ),
            ),
            Recipe(
                name="tabular",
                description=(
                    "Breast cancer diagnosis (mlp 30-64-64-2) from the 30 raw Wisconsin features in sklearn's "
                    "column order; standardization is folded into the first layer, so send features unscaled."
                ),
                load_data=datasets.breast_cancer,
                architecture="mlp",
                arch_kwargs=_frozen(in_features=30, hidden=(64, 64), out_features=2, dropout=0.1),
                input_name="features",
                epochs=10,
                batch_size=32,
                lr=1e-3,
                weight_decay=1e-4,
                standardize=True,
            ),
        )
    }
)
"""The bundled recipes by name."""


def get(name: str) -> Recipe:
    """The recipe called ``name``."""
    try:
        return RECIPES[name]
    except KeyError:
        raise UnknownRecipeError(f"unknown recipe {name!r} (choose from: {', '.join(sorted(RECIPES))})") from None
