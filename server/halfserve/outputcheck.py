"""A model's forward against the outputs its manifest declares: how many, each one's shape per row, and whether it is
floating, integer or boolean.

A declared output the forward does not return as declared is a model whose metadata lies to clients: V2 metadata of
``[-1, 2]`` for answers of shape ``[3]``, labels indexed past a row that has none (a 500 on every ``/predict``). So
``halfserve import --output`` is checked on one forward before anything is written, and a version whose stored
manifest no longer fits its model fails its load with the reason rather than its requests; so does one whose declared
inputs do not run through its model at all, or whose forward answers one row with other than one row (a batch of one
is what warm-up and a lone request run).

The forward runs in fp32 on the host weights, on :data:`ROWS` rows of zeros (at load, then on one row; a mask input
all ones, a variable input :data:`halfserve.calibration.SAMPLE_LENGTH` long at most), as the server would pass them:
floating inputs as fp32, normalised where the manifest says so, one input positionally and several by keyword.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from halfserve import packing, records
from halfserve.calibration import SAMPLE_LENGTH
from halfserve.engine.inputs import Normalizer, takes_positionally
from halfserve.instance import torch_dtype
from halfserve.manifest import Manifest, Normalize, TensorSpec
from halfserve.storage import MANIFEST, StoreError
from halfserve.store import LoadedModel

ROWS = 2
"""Rows of the checking forward: two, so that an output's rows show as in a batch (at load, one row follows, where an
output that drops its batch dimension for one row, ``squeeze()``, shows)."""


ONE_ROW = "a batch of one (a lone request) must be answered with one row: keep the batch dimension (squeeze() drops it)"
"""What to do about a forward that answers a batch of one with other than one row."""


class OutputMismatchError(StoreError):
    """A model whose forward does not return the outputs its manifest declares."""


class InputMismatchError(StoreError):
    """A model whose forward fails on rows of the inputs its manifest declares."""


def forward(
    module: nn.Module, inputs: list[TensorSpec], normalize: Normalize | None = None, rows: int = ROWS
) -> object:
    """What ``module`` (fp32, on the host) returns for ``rows`` rows of zeros of ``inputs``; the model's own
    exception where its forward fails on them."""
    tensors = []
    for spec in inputs:
        length = min(SAMPLE_LENGTH, spec.max_length or SAMPLE_LENGTH)
        t = (torch.ones if spec.mask_for else torch.zeros)(
            (rows, *spec.bounded(length)), dtype=torch_dtype(spec.datatype.numpy)
        )
        if normalize is not None:  # a manifest normalises its one input, before the cast to the weights' dtype
            t = Normalizer(normalize, len(spec.shape), torch.device("cpu"))(t)
        tensors.append(t.float() if t.is_floating_point() else t)
    with torch.inference_mode():
        return call(module, inputs, tensors)


def call(module: nn.Module, specs: list[TensorSpec], tensors: list[torch.Tensor]) -> object:
    """The forward as the server runs it: one input positionally, several by keyword (or ``*args``)."""
    names = [t.name for t in specs]
    if len(names) == 1 or takes_positionally(module, names):
        return module(*tensors)
    return module(**dict(zip(names, tensors, strict=True)))


def mismatch(y: object, manifest: Manifest, rows: int = ROWS) -> str | None:
    """Why ``y``, what a forward of ``rows`` rows returned, does not give ``manifest``'s outputs; ``None`` where it
    does. A model with several outputs or variable dimensions may return fewer values along an output's first
    dimension than declared: the server pads its rows with zeros (fewer detections than a detector's most)."""
    try:
        named = records.named_outputs(y, [t.name for t in manifest.outputs])
    except records.OutputError as e:
        return str(e)
    pads = packing.packs_records(manifest)
    for spec in manifest.outputs:
        t = named[spec.name]
        if t.ndim == 0 or t.shape[0] != rows:
            got = "a scalar" if t.ndim == 0 else f"{t.shape[0]} rows"
            return f"output {spec.name!r} has {got} for {_rows(rows, 'input ')}, not one row per input row"
        shape = list(t.shape[1:])
        if not _fits(spec.shape, shape, pads):
            return f"output {spec.name!r} has rows of shape {shape}, declared {spec.shape}"
        if (got := _kind(t)) != (declared := _KINDS.get(spec.datatype.numpy.kind, "integer")):
            return f"output {spec.name!r} is {got} ({_dtype(t)}), declared {spec.datatype.value} ({declared})"
    return None


def returned(y: object, rows: int = ROWS) -> str:
    """What a forward of ``rows`` rows returned, tensor by tensor (each one's shape per row and dtype), to set beside
    the declared outputs."""
    if isinstance(y, torch.Tensor):
        return f"one tensor, {_tensor(y, rows)}"
    if isinstance(y, Mapping):
        return "a mapping: " + ", ".join(f"{k} {_tensor(v, rows)}" for k, v in y.items())
    if isinstance(y, tuple | list):
        return f"a {type(y).__name__}: " + ", ".join(f"[{i}] {_tensor(v, rows)}" for i, v in enumerate(y))
    return type(y).__name__


def at_load(loaded: LoadedModel) -> None:
    """An :class:`OutputMismatchError` naming the manifest, the output and what the forward returns, where ``loaded``'s
    model does not return its declared outputs for :data:`ROWS` rows or for one; an :class:`InputMismatchError`
    naming the manifest and its inputs, with the model's own error, where its forward fails on them."""
    manifest = loaded.manifest
    where = loaded.path.parent.parent / MANIFEST
    for rows in (ROWS, 1):
        try:
            y = forward(loaded.module, manifest.inputs, manifest.normalize, rows)
        except Exception as e:  # the model's own code
            declared = ", ".join(f"{t.name} {t.datatype.value} {t.shape}" for t in manifest.inputs)
            raise InputMismatchError(
                f"{where}: inputs: the declared inputs ({declared}) did not run through the model ({_rows(rows)} of "
                f"zeros, fp32): {type(e).__name__}: {e}"
            ) from None
        reason = mismatch(y, manifest, rows)
        if reason is not None:
            fix = ONE_ROW if rows == 1 else "the manifest's outputs must say what it returns"
            raise OutputMismatchError(
                f"{where}: outputs: {reason}; the model's forward returns {returned(y, rows)} "
                f"(for {_rows(rows)}): {fix}"
            )


def _rows(n: int, kind: str = "") -> str:
    return f"{n} {kind}row{'' if n == 1 else 's'}"


_KINDS = {"f": "floating", "b": "boolean"}
"""The kinds of numpy dtype that are not integers (``i``, ``u``)."""


def _kind(t: torch.Tensor) -> str:
    if t.is_floating_point():
        return "floating"
    if t.dtype == torch.bool:
        return "boolean"
    return "complex" if t.is_complex() else "integer"


def _fits(declared: list[int], rows: list[int], pads: bool) -> bool:
    if len(declared) != len(rows) or declared[1:] != rows[1:]:
        return False
    if not declared:  # one value per row
        return True
    first = declared[0]
    return first == -1 or rows[0] == first or (pads and rows[0] < first)


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _tensor(v: object, rows: int = ROWS) -> str:
    if not isinstance(v, torch.Tensor):
        return type(v).__name__
    if v.ndim == 0 or v.shape[0] != rows:
        return f"shape {list(v.shape)} {_dtype(v)} (not one row per input row)"
    return f"rows of shape {list(v.shape[1:])} {_dtype(v)}"
