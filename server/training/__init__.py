"""Training for servable models: mixed-precision (AMP) loops over datasets bundled with scikit-learn.

A run writes a new numbered version into the model store through :mod:`server.store`, with a report (per-step
metrics, plots) and an evaluation of the checkpoint served in fp32, fp16 and bf16. Needs the ``train`` extra
(scikit-learn, matplotlib, rich).
"""

from __future__ import annotations

from server.training.config import TrainConfig
from server.training.errors import TrainingError, UnknownRecipeError
from server.training.evaluation import Evaluation
from server.training.recipes import RECIPES, Recipe
from server.training.trainer import TrainResult, run, train

__all__ = [
    "RECIPES",
    "Evaluation",
    "Recipe",
    "TrainConfig",
    "TrainResult",
    "TrainingError",
    "UnknownRecipeError",
    "run",
    "train",
]
