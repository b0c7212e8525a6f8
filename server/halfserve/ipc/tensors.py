"""Named tensors in a frame: their places in its header, their bytes in its payload or in shared memory.

A header lists tensors as ``[name, dtype, shape, offset]``, their bytes one after another from ``offset``, in the
payload (:func:`inline`, :func:`from_payload`) or in a slot of shared memory (:class:`halfserve.ipc.memory.Slots`).
``dtype`` is numpy's ``dtype.str``; a dtype with fields (numpy records) travels as :func:`descr` describes it.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np

from halfserve.serving import Tensors

TensorList = list[list[Any]]
"""Named tensors' places in a header: ``[name, dtype, shape, offset]`` each."""


def nbytes(tensors: Tensors) -> int:
    """Bytes the tensors take one after another."""
    if len(tensors) == 1:  # the common case, on every request
        return next(iter(tensors.values())).nbytes
    return sum(a.nbytes for a in tensors.values())


def inline(tensors: Tensors) -> tuple[TensorList, list[memoryview]]:
    """``tensors`` as a frame's payload: their places in it, and its parts (the arrays' own bytes, not copied)."""
    places, parts, offset = [], [], 0
    for name, a in tensors.items():
        places.append([name, a.dtype.str, a.shape, offset])
        parts.append(np.ascontiguousarray(a).data.cast("B"))
        offset += a.nbytes
    return places, parts


def from_payload(payload: bytearray, places: TensorList) -> dict[str, np.ndarray]:
    """The tensors at ``places`` in a frame's payload (arrays over it, not copies)."""
    out = {}
    for name, dtype, shape, offset in places:
        dt = np.dtype(dtype)
        out[name] = np.frombuffer(payload, dt, math.prod(shape), offset).reshape(shape)
    return out


@functools.lru_cache(maxsize=64)
def descr(dtype: np.dtype[Any]) -> Any:
    """A JSON-able description of ``dtype`` (records included), which :func:`dtype_of` reads back."""
    return np.lib.format.dtype_to_descr(dtype)


def dtype_of(description: Any) -> np.dtype[Any]:
    """The dtype :func:`descr` described, after a JSON round trip (which turned its tuples into lists)."""
    return np.lib.format.descr_to_dtype(_tuples(description))


def _tuples(description: Any) -> Any:
    if isinstance(description, str):
        return description
    return [
        (f[0], _tuples(f[1]), tuple(f[2])) if len(f) > 2 else (f[0], _tuples(f[1]))  # name, type[, shape]
        for f in description
    ]
