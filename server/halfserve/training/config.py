"""Options of a training run: resolved against the recipe and the device, and validated, before anything runs."""

from __future__ import annotations

import importlib.util
import math
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from halfserve.precision import DTYPE_NAMES, default_device, default_training_dtype
from halfserve.training import recipes
from halfserve.training.errors import TrainingError
from halfserve.training.recipes import Recipe

OPTIONAL_DEPENDENCIES = {"sklearn": "scikit-learn", "matplotlib": "matplotlib", "rich": "rich"}
"""The ``train`` extra: imported only by training, so ``halfserve serve`` runs without them."""


def dtype_name(dtype: torch.dtype) -> str:
    """``fp16`` / ``bf16`` / ``fp32`` for a training dtype."""
    return next(name for name, d in DTYPE_NAMES.items() if d is dtype)


MAX_LR = 1e6
"""The largest learning rate taken: far past any that trains, and well inside float32, whose optimizer steps a larger
one overflows (1e39 crashed AdamW)."""


@dataclass(frozen=True)
class TrainConfig:
    """Everything one training run needs, resolved and validated; built by :meth:`create`."""

    recipe: Recipe
    store: Path
    device: torch.device
    dtype: torch.dtype
    epochs: int
    max_steps: int | None
    batch_size: int
    lr: float
    seed: int
    resume: bool
    progress: bool
    save_state: bool

    @classmethod
    def create(
        cls,
        recipe: str | Recipe,
        store: Path | str = "model_store",
        *,
        precision: str | None = None,
        epochs: int | None = None,
        max_steps: int | None = None,
        batch_size: int | None = None,
        lr: float | None = None,
        seed: int = 0,
        resume: bool = False,
        device: str | torch.device | None = None,
        progress: bool = False,
        save_state: bool = True,
    ) -> TrainConfig:
        """Fill unset options from the recipe and the device; raise :class:`TrainingError` on a bad one."""
        rec = recipes.get(recipe) if isinstance(recipe, str) else recipe
        dev = resolve_device(device)
        if precision is None:
            dtype = default_training_dtype(dev)
        elif precision in DTYPE_NAMES:
            dtype = DTYPE_NAMES[precision]
        else:
            raise TrainingError(f"unknown precision {precision!r} (choose from: {', '.join(DTYPE_NAMES)})")
        config = cls(
            recipe=rec,
            store=Path(store),
            device=dev,
            dtype=dtype,
            epochs=rec.epochs if epochs is None else epochs,
            max_steps=max_steps,
            batch_size=rec.batch_size if batch_size is None else batch_size,
            lr=rec.lr if lr is None else lr,
            seed=seed,
            resume=resume,
            progress=progress,
            save_state=save_state,
        )
        for name in ("epochs", "batch_size"):
            if getattr(config, name) < 1:
                raise TrainingError(f"{name} must be at least 1, got {getattr(config, name)}")
        if max_steps is not None and max_steps < 1:
            raise TrainingError(f"max_steps must be at least 1, got {max_steps}")
        if not (math.isfinite(config.lr) and 0 < config.lr <= MAX_LR):
            raise TrainingError(f"lr must be a positive number up to {MAX_LR:g}, got {config.lr}")
        return config

    @property
    def precision(self) -> str:
        return dtype_name(self.dtype)


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``device`` as a torch.device (CUDA when present if ``None``); an unusable one is a :class:`TrainingError`."""
    if device is None:
        return default_device()
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise TrainingError(f"invalid device {str(device)!r}: {e}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise TrainingError(f"device {dev} requested but CUDA is not available")
    if dev.type not in ("cpu", "cuda"):
        raise TrainingError(f"device {dev}: only cpu and cuda are supported")
    return dev


def check_dependencies() -> None:
    """Fail with the install command when the ``train`` extra is missing."""
    missing = [dist for module, dist in OPTIONAL_DEPENDENCIES.items() if importlib.util.find_spec(module) is None]
    if missing:
        raise TrainingError(f"training needs {', '.join(missing)}: pip install 'halfserve[train]'")


def check_writable(root: Path) -> None:
    """Fail before training, not after minutes of it, when the store cannot take a new version."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=root):
            pass
    except OSError as e:
        raise TrainingError(f"cannot write to model store {root}: {e.strerror or e}") from None
