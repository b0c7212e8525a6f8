"""Training state kept beside the served weights, so a later run can resume where this one stopped.

``<version_dir>/train_state.pt`` holds the optimizer's and the GradScaler's state dicts and the loop counters: only
tensors, numbers, strings and containers of them, so it is read back with ``torch.load(weights_only=True)``, which
refuses to unpickle anything else. The model's weights are *not* duplicated here; they are the version's
``model.safetensors``.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from halfserve.training.errors import TrainingError

STATE_FILE = "train_state.pt"
FORMAT = 1
"""Bumped when the layout of the saved dict changes incompatibly."""


@dataclass(frozen=True)
class TrainState:
    """Where a training run stopped."""

    recipe: str
    precision: str
    """The training dtype name (``fp16``, ``bf16``, ``fp32``) the state was produced under."""
    epoch: int
    """Epochs begun so far; a run cut short by ``max_steps`` counts its last, partial epoch."""
    step: int
    """Optimizer steps taken so far (skipped fp16 steps included)."""
    skipped_steps: int
    seed: int
    seconds: float
    """Training wall time so far, over all runs of the chain."""
    optimizer: dict[str, Any]
    scaler: dict[str, Any]
    """``GradScaler.state_dict()``; empty when the scaler was disabled (bf16/fp32)."""


_FIELDS: dict[str, type | tuple[type, ...]] = {
    "recipe": str,
    "precision": str,
    "epoch": int,
    "step": int,
    "skipped_steps": int,
    "seed": int,
    "seconds": (float, int),
    "optimizer": dict,
    "scaler": dict,
}


def save(version_dir: Path, state: TrainState) -> Path:
    """Write ``<version_dir>/train_state.pt``."""
    path = version_dir / STATE_FILE
    torch.save({"format": FORMAT, **asdict(state)}, path)
    return path


def load(version_dir: Path) -> TrainState:
    """Read ``<version_dir>/train_state.pt`` safely; errors name the file and what is wrong."""
    path = version_dir / STATE_FILE
    if not path.is_file():
        if os.path.lexists(path):  # a folder, a device, a pipe (which would block the read), a broken link
            raise TrainingError(f"{path}: not a regular file; the training state is one")
        raise TrainingError(f"{path}: no training state to resume from (was that version trained with --no-state?)")
    try:
        with warnings.catch_warnings():  # torch warns of a crafted file's pickle protocol before refusing it
            warnings.simplefilter("ignore")
            raw = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # unpickling errors come in many types; all mean the file is unusable
        raise TrainingError(f"{path}: cannot read training state ({type(e).__name__}: {_essence(e)})") from None
    if not isinstance(raw, dict):
        raise TrainingError(f"{path}: expected a dict, found {type(raw).__name__}")
    if raw.get("format") != FORMAT:
        raise TrainingError(f"{path}: format: expected {FORMAT}, found {raw.get('format')!r}")
    for name, kind in _FIELDS.items():
        if not isinstance(raw.get(name), kind):
            raise TrainingError(f"{path}: {name}: missing or of the wrong type ({type(raw.get(name)).__name__})")
    return TrainState(**{name: raw[name] for name in _FIELDS})


def _essence(error: Exception) -> str:
    """One line of an error message: torch's weights-only refusal spans a dozen lines of advice."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    reason = next((line for line in lines if line.startswith("WeightsUnpickler error:")), lines[0] if lines else "")
    return reason.removeprefix("WeightsUnpickler error:").strip()
