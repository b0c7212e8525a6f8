"""Decoding request tensors into numpy arrays and checking them against a model's input signature."""

from __future__ import annotations

from typing import Any

import numpy as np

from server.api.binary import check_range
from server.api.errors import APIError
from server.store import DataType, TensorSpec

# BF16 has no numpy dtype: it is decoded as float32 and the engine casts it.
NUMPY_DTYPES: dict[DataType, np.dtype[Any]] = {
    DataType.FP32: np.dtype(np.float32),
    DataType.FP16: np.dtype(np.float16),
    DataType.BF16: np.dtype(np.float32),
    DataType.FP64: np.dtype(np.float64),
    DataType.INT64: np.dtype(np.int64),
    DataType.INT32: np.dtype(np.int32),
    DataType.UINT8: np.dtype(np.uint8),
}


def decode_samples(samples: Any, spec: TensorSpec, field: str = "inputs") -> np.ndarray:
    """A JSON list of samples (each a nested list of the per-sample shape) as one array, rows first.

    Raises :class:`APIError` (400) naming ``field`` when the list is empty, ragged, non-numeric or mis-shaped.
    """
    if not isinstance(samples, list):
        raise APIError(400, f"{field}: expected a list of samples, got {type(samples).__name__}")
    if not samples:
        raise APIError(400, f"{field}: empty; send at least one sample")
    try:
        # Without a dtype numpy keeps strings and None as such, so they are caught below instead of coerced.
        arr = np.asarray(samples)
    except ValueError:
        raise APIError(400, f"{field}: samples are ragged (nested lists of unequal length)") from None
    if arr.dtype.kind not in "iuf":
        raise APIError(400, f"{field}: values must be numbers, got {_kind_name(arr)}")
    want = tuple(spec.shape)
    if arr.shape[1:] != want:
        got = list(arr.shape[1:]) if arr.ndim > 1 else "a scalar"
        raise APIError(400, f"{field}: each sample must have shape {list(want)}, got {got}")
    return cast_json_numbers(arr, NUMPY_DTYPES[spec.datatype], field)


def cast_json_numbers(arr: np.ndarray, dtype: np.dtype[Any], field: str) -> np.ndarray:
    """Numbers decoded from JSON as ``dtype``, or a 400 naming ``field`` when one does not fit it.

    JSON (as orjson reads it) carries no NaN or infinity, so this cast is the one place a JSON value could become
    non-finite (``1e39`` as float32) or wrap (``1e20`` as int32): refusing it here leaves JSON inputs finite without
    a separate check. An integer input takes whole numbers that fit its type: a cast would truncate ``1.5`` and wrap
    ``256`` (as UINT8) silently.
    """
    if dtype.kind in "iu":
        if arr.dtype.kind != "f":
            check_range(arr, dtype, field)
        elif not np.array_equal(arr, np.trunc(arr)):
            raise APIError(400, f"{field}: the input takes integers ({dtype.name}), got fractional values")
        elif arr.size and (arr.min() < np.iinfo(dtype).min or arr.max() > np.iinfo(dtype).max):
            raise APIError(400, f"{field}: values beyond the range of {dtype.name}")
        return arr.astype(dtype, copy=False)
    try:
        with np.errstate(over="raise", invalid="raise"):
            return arr.astype(dtype, copy=False)
    except FloatingPointError:
        raise APIError(400, f"{field}: values beyond the range of {dtype.name}") from None


def _kind_name(arr: np.ndarray) -> str:
    return {"b": "booleans", "U": "strings", "S": "bytes", "O": "non-numeric values (null or mixed)"}.get(
        arr.dtype.kind, str(arr.dtype)
    )
