"""Errors the training module reports to its caller as one line (the CLI turns them into exit code 2)."""

from __future__ import annotations


class TrainingError(Exception):
    """Training cannot start or continue: a bad option, an unwritable store, nothing to resume from."""


class UnknownRecipeError(TrainingError):
    """No recipe has the requested name."""
