"""A batch's output rows: checked against its input rows, cut back per request chunk, and checked finite (the
overflow check of half-precision outputs)."""

from __future__ import annotations

import numpy as np
import torch

from halfserve.engine.protocol import EngineError


def rows_finite(a: np.ndarray) -> np.ndarray:
    """Per row: True when every value of the row is finite (integers always are), every field's of a record."""
    if a.dtype.names is not None:
        rows = np.ones(a.shape[0], dtype=bool)
        for name in a.dtype.names:
            rows &= rows_finite(a[name])
        return rows
    if a.dtype.kind not in "fc":
        return np.ones(a.shape[0], dtype=bool)
    finite: np.ndarray = np.isfinite(a.reshape(a.shape[0], -1)).all(axis=1)
    return finite


def row_slices(out: np.ndarray, chunks: list[np.ndarray]) -> list[np.ndarray]:
    """``out``'s rows cut back into one view per chunk, in order: slices, which cost a fraction of ``np.split``'s
    per-piece work when a batch holds dozens of one-row requests."""
    if len(chunks) == 1:
        return [out]
    views, start = [], 0
    for c in chunks:
        stop = start + len(c)
        views.append(out[start:stop])
        start = stop
    return views


def all_finite(a: np.ndarray) -> bool:
    """Whether every value is finite, every field's of a record: one vectorised check per field."""
    if a.dtype.names is not None:
        return all(all_finite(a[name]) for name in a.dtype.names)
    return a.dtype.kind not in "fc" or bool(np.isfinite(a).all())


def checked(y: object, rows: int) -> torch.Tensor:
    if not isinstance(y, torch.Tensor):
        raise EngineError(f"model returned {type(y).__name__}, expected a tensor")
    if y.shape[0] != rows:
        raise EngineError(f"batch size mismatch: model returned {y.shape[0]} rows for {rows} inputs")
    return y
