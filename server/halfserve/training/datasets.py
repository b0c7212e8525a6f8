"""Bundled datasets: scikit-learn's own copies, so training never downloads anything.

Each loader returns a fixed stratified 80/20 split as fp32 tensors shaped exactly as a client sends one sample to the
server (``[1, 8, 8]`` images, ``[256]`` pixel vectors, ``[30]`` raw features), so the served model and the training
module agree on the input without any preprocessing on the server.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812

TEST_FRACTION = 0.2
SPLIT_SEED = 0
"""``random_state`` of the train/test split; fixed so every run, and every resume, sees the same test set."""


@dataclass(frozen=True)
class Dataset:
    """A train/test split of one bundled dataset, as the server will receive it."""

    name: str
    source: str
    """The scikit-learn function the data comes from."""
    preprocessing: str
    """What was done to the raw data; clients must do the same before sending a sample."""
    labels: tuple[str, ...]
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor

    @property
    def sample_shape(self) -> list[int]:
        """Per-sample input shape, without the batch dimension."""
        return list(self.x_train.shape[1:])

    @property
    def num_classes(self) -> int:
        return len(self.labels)

    def describe(self) -> dict[str, Any]:
        """The manifest's ``dataset`` entry."""
        return {
            "name": self.name,
            "source": self.source,
            "preprocessing": self.preprocessing,
            "n_train": int(self.x_train.shape[0]),
            "n_test": int(self.x_test.shape[0]),
            "split": f"stratified {1 - TEST_FRACTION:.0%}/{TEST_FRACTION:.0%}, random_state={SPLIT_SEED}",
        }


def _split(
    name: str,
    source: str,
    preprocessing: str,
    labels: tuple[str, ...],
    x: Any,
    y: Any,
    x_dtype: torch.dtype = torch.float32,
) -> Dataset:
    from sklearn.model_selection import train_test_split

    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=TEST_FRACTION, stratify=y, random_state=SPLIT_SEED
    )
    return Dataset(
        name=name,
        source=source,
        preprocessing=preprocessing,
        labels=labels,
        x_train=torch.as_tensor(np.ascontiguousarray(x_train), dtype=x_dtype),
        y_train=torch.as_tensor(np.asarray(y_train), dtype=torch.long),
        x_test=torch.as_tensor(np.ascontiguousarray(x_test), dtype=x_dtype),
        y_test=torch.as_tensor(np.asarray(y_test), dtype=torch.long),
    )


def _digit_images() -> tuple[torch.Tensor, Any, tuple[str, ...]]:
    from sklearn.datasets import load_digits

    bunch = load_digits()
    # Pixel values are integers 0..16; scaling to 0..1 keeps activations small enough for fp16.
    images = torch.as_tensor(bunch.images, dtype=torch.float32).unsqueeze(1) / 16.0
    return images, bunch.target, tuple(str(int(t)) for t in bunch.target_names)


def digits_8x8() -> Dataset:
    """sklearn's 8x8 handwritten digits as ``[1, 8, 8]`` images scaled to 0..1; labels ``"0"``..``"9"``."""
    images, target, labels = _digit_images()
    return _split(
        "digits",
        "sklearn.datasets.load_digits",
        "pixel values 0..16 divided by 16; shape [1, 8, 8]",
        labels,
        images.numpy(),
        target,
    )


def digits_16x16_flat() -> Dataset:
    """The same digits, bilinearly upsampled to 16x16 and flattened to 256 features (the benchmark MLP's input)."""
    images, target, labels = _digit_images()
    upsampled = F.interpolate(images, size=(16, 16), mode="bilinear", align_corners=False)
    return _split(
        "digits",
        "sklearn.datasets.load_digits",
        "pixel values 0..16 divided by 16, bilinearly upsampled to 16x16 (align_corners=False), flattened to [256]",
        labels,
        upsampled.flatten(1).numpy(),
        target,
    )


SEQUENCE_PAD = 0
"""The token that pads a digit sequence (pixel tokens are 1..17)."""


def digits_sequence() -> Dataset:
    """The digits read row by row as a token sequence: each pixel value 0..16 becomes token 1..17, and each image is
    cropped to its first 6 to 8 rows (seeded per image), so lengths run 48..64; padded with token 0 to 64 for
    training only (the server pads what it batches and builds the mask)."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    tokens = bunch.data.astype(np.int64) + 1  # [n, 64], row by row
    rows = np.random.default_rng(SPLIT_SEED).integers(6, 9, len(tokens))
    positions = np.arange(64)[None, :]
    tokens = np.where(positions < rows[:, None] * 8, tokens, SEQUENCE_PAD)
    return _split(
        "digits",
        "sklearn.datasets.load_digits",
        "each 8x8 image read row by row, pixel value v (0..16) as token v + 1, cropped to its first 6..8 rows "
        "(numpy default_rng(0) per image): send the tokens, 48..64 of them, unpadded",
        tuple(str(int(t)) for t in bunch.target_names),
        tokens,
        bunch.target,
        x_dtype=torch.int64,
    )


def breast_cancer() -> Dataset:
    """The Wisconsin breast cancer table: 30 raw (unstandardized) features; labels ``malignant`` / ``benign``."""
    from sklearn.datasets import load_breast_cancer

    bunch = load_breast_cancer()
    return _split(
        "breast_cancer",
        "sklearn.datasets.load_breast_cancer",
        "none: raw features in sklearn's column order (standardization is folded into the model)",
        tuple(str(t) for t in bunch.target_names),
        bunch.data.astype(np.float32),
        bunch.target,
    )
