"""A request's rows as one numpy record array: how a model with several inputs or outputs, or a variable dimension,
batches its rows (the layout its manifest, :mod:`halfserve.manifest`, gives); torch-free, so the routes pack a
request before it is queued. The engine's side of the records, as device tensors, is :mod:`halfserve.records`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from halfserve.manifest import Manifest, TensorSpec, sent_inputs

LENGTH = "#length"
"""Suffix of the record field holding each row's length of a variable input (``#`` is in no tensor's name)."""


def input_records(manifest: Manifest) -> np.dtype[Any]:
    """The numpy record type that carries one request row of a model's inputs, one field per input (its per-sample
    shape, a variable one at its ``max_length``, and host dtype), plus each variable input's length in that row:
    how a model with several inputs, several outputs or variable dimensions batches its rows as one array. Masks are
    left out: the engine builds them."""
    fields: list[tuple[str, Any, tuple[int, ...]]] = []
    for spec in sent_inputs(manifest):
        fields.append((spec.name, spec.datatype.numpy, tuple(spec.bounded())))
        if spec.variable:
            fields.append((spec.name + LENGTH, np.int32, ()))
    return np.dtype(fields)


def output_records(manifest: Manifest) -> np.dtype[Any]:
    """The record type of one row of a model's outputs (floating ones as float32, as the engine returns them; a
    variable one at the first variable input's ``max_length``)."""
    sequence = sequence_input(manifest)
    length = sequence.max_length if sequence is not None else None
    fields = []
    for spec in manifest.outputs:
        dtype = spec.datatype.numpy
        if dtype.kind == "f":
            dtype = np.dtype(np.float32)
        fields.append((spec.name, dtype, tuple(spec.bounded(length))))
    return np.dtype(fields)


def sequence_input(manifest: Manifest) -> TensorSpec | None:
    """The first variable input clients send: the length variable outputs follow and requests are grouped by."""
    return next((t for t in sent_inputs(manifest) if t.variable), None)


def packs_records(manifest: Manifest) -> bool:
    """Whether a model's rows travel as records: several inputs or outputs, or a variable dimension."""
    return len(manifest.inputs) > 1 or len(manifest.outputs) > 1 or any(t.variable for t in manifest.inputs)


class PackError(ValueError):
    """A request's inputs do not fit the model's (missing, unexpected, rows or lengths); the message names the input."""


def length_bucket(length: int, limit: int) -> int:
    """The padded length of a batch whose longest row is ``length``: the next power of two from 8, at most ``limit``
    (a few fixed shapes, and requests of similar lengths grouped into one batch)."""
    bucket = 8
    while bucket < length:
        bucket *= 2
    return min(bucket, limit)


def padded_length(manifest: Manifest, spec: TensorSpec, longest: int) -> int:
    """The length a batch of variable input ``spec`` whose longest row is ``longest`` is padded to: its length bucket
    when the model groups lengths (``batching.group_lengths``), else that longest row."""
    if not manifest.batching.group_lengths:
        return longest
    return length_bucket(longest, spec.max_length or longest)


def pack(manifest: Manifest, arrays: Mapping[str, np.ndarray]) -> np.ndarray:
    """A request's named inputs (rows first, each a rectangle) as records (:func:`input_records`): each variable
    input padded to its ``max_length`` with its ``pad`` value and its length kept per row (longer ones refused, or cut
    with ``truncate``). Raises :class:`PackError` naming the input."""
    specs = sent_inputs(manifest)
    names = [t.name for t in specs]
    companions = {t.name + LENGTH for t in specs if t.variable}
    unknown = [n for n in arrays if n not in names and n not in companions]
    if unknown:
        raise PackError(f"inputs: unexpected input {unknown[0]!r}; the model takes {names}")
    missing = [n for n in names if n not in arrays]
    if missing:
        raise PackError(f"inputs: input {missing[0]!r} is missing; the model takes {names}")
    rows = len(arrays[names[0]])
    for name in names[1:]:
        if len(arrays[name]) != rows:
            raise PackError(
                f"inputs: input {name!r} has {len(arrays[name])} rows but {names[0]!r} has {rows}; "
                "a request's inputs must have the same number of rows"
            )
    packed = np.empty(rows, dtype=input_records(manifest))
    for spec in specs:
        a = arrays[spec.name]
        try:
            if spec.variable:
                if a.ndim != len(spec.shape) + 1 or list(a.shape[2:]) != spec.shape[1:] or a.shape[1] < 1:
                    raise PackError(
                        f"inputs: input {spec.name!r} has samples of shape {list(a.shape[1:])}, not {spec.shape}"
                    )
                length = check_length(spec, a.shape[1], f"inputs: input {spec.name!r}")
                field = packed[spec.name]
                field[:, :length] = a[:, :length]
                field[:, length:] = spec.pad
                given = arrays.get(spec.name + LENGTH)
                if given is None:
                    packed[spec.name + LENGTH] = length
                else:  # each row's own length (tokenized texts of one request): the row is padded after it
                    if given.shape != (rows,) or given.min() < 1 or given.max() > length:
                        raise PackError(f"inputs: {spec.name + LENGTH!r}: row lengths must be 1..{length}, one per row")
                    packed[spec.name + LENGTH] = given
                    field[np.arange(spec.bounded()[0])[None, :] >= given[:, None]] = spec.pad
            else:
                packed[spec.name] = a
        except PackError:
            raise
        except (ValueError, TypeError) as e:
            raise PackError(f"inputs: input {spec.name!r} does not fit {spec.shape} per row: {e}") from None
    return packed


def check_length(spec: TensorSpec, length: int, where: str) -> int:
    """The length a variable input of ``length`` is served at: itself, cut to ``max_length`` with ``truncate``; a
    :class:`PackError` naming ``where`` and the limit when it is longer and not cut."""
    limit = spec.max_length or length
    if length <= limit:
        return length
    if spec.truncate:
        return limit
    raise PackError(f"{where}: length {length} is longer than its max_length {limit} (or set truncate)")
