"""Training for servable models: mixed-precision (AMP) loops over datasets bundled with scikit-learn.

A run writes a new numbered version into the model store through :mod:`halfserve.store`, with a report (per-step
metrics, plots) and an evaluation of the checkpoint served in fp32, fp16 and bf16. Needs the ``train`` extra
(scikit-learn, matplotlib, rich).
"""

from __future__ import annotations

from halfserve.training.config import TrainConfig
from halfserve.training.errors import TrainingError, UnknownRecipeError
from halfserve.training.evaluation import Evaluation
from halfserve.training.recipes import RECIPES, Recipe
from halfserve.training.trainer import TrainResult, run, train

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
