"""What a team's handler returns, checked (the manifest's ``handler`` section, :mod:`halfserve.handlers`): the inputs
``preprocess`` gives the model and the answers ``postprocess`` gives back. Both places a handler runs check them the
same way: the data plane's handler threads (:mod:`halfserve.api.dataplane.handled`) and an instance process
(:mod:`halfserve.isolated.handling`), which imports nothing of ``api/``.

Everything wrong here is the handler's, an :class:`~halfserve.errors.InternalError` (a 500) naming what was expected
and what came. Torch-free: a torch tensor is read through its ``detach`` without importing torch.
"""

from __future__ import annotations

import numpy as np
import orjson

from halfserve.errors import InternalError, InvalidInputError
from halfserve.handlers import one_line
from halfserve.manifest import Manifest, TensorSpec
from halfserve.packing import PackError, check_length
from halfserve.serving import Tensors


def _array(value: object, where: str) -> np.ndarray:
    """``value`` (a numpy array, a torch tensor, or nested lists of numbers) as an array."""
    detach = getattr(value, "detach", None)
    if callable(detach):  # a torch tensor, read without importing torch
        value = detach().cpu().numpy()
    try:
        array = np.asarray(value)
    except (TypeError, ValueError) as e:
        raise InternalError(f"{where}: not an array: {one_line(e)}") from None
    if array.dtype == object or array.dtype.kind not in "biuf":
        raise InternalError(f"{where}: expected numbers, got an array of {array.dtype}")
    return array


def _dims(shape: list[int]) -> str:
    return "[" + ",".join(str(d) for d in shape) + "]"


def _check_shape(dims: list[int], spec: TensorSpec, model: str, where: str) -> None:
    """Rows first, then the input's shape (a variable dimension at least 1 long and within its ``max_length``)."""
    if dims and dims[0] >= 1 and dims[1:] == spec.shape:
        return
    if spec.variable and len(dims) == len(spec.shape) + 1 and dims[2:] == spec.shape[1:] and min(dims[:2]) >= 1:
        try:
            check_length(spec, dims[1], f"{where}: input {spec.name!r}")
        except PackError as e:
            raise InternalError(str(e)) from None
        return
    raise InternalError(
        f"{where}: unexpected shape for input {spec.name!r} for model {model!r}. "
        f"Expected {_dims([-1, *spec.shape])}, got {_dims(dims)}"
    )


def checked_inputs(value: object, manifest: Manifest, rows: int) -> Tensors:
    """What ``preprocess`` returned as the model's inputs: an array (a model of one input) or a mapping by input name,
    each ``rows`` rows of the input's shape, in a dtype that casts to the input's by numpy's ``same_kind`` rule
    (floats to the input's floats, integers to its integers or floats, never floats to integers); an
    :class:`InternalError` naming what was expected and what came, an :class:`InvalidInputError` for NaN or infinite
    values the model does not accept."""
    specs = manifest.inputs
    names = [t.name for t in specs]
    if isinstance(value, dict):
        given = value
    elif len(specs) == 1:
        given = {specs[0].name: value}
    else:
        raise InternalError(
            f"handler preprocess returned {type(value).__name__}; expected a dict of the inputs {names}"
        )
    if sorted(map(str, given)) != sorted(names):
        raise InternalError(f"handler preprocess returned inputs {sorted(map(str, given))}; expected {sorted(names)}")
    out: dict[str, np.ndarray] = {}
    for spec in specs:
        where = f"handler preprocess returned {spec.name!r}"
        array = _array(given[spec.name], where)
        want = spec.datatype.numpy
        if not np.can_cast(array.dtype, want, "same_kind"):
            raise InternalError(f"{where} of {array.dtype}; expected {want} (the input's {spec.datatype.value})")
        _check_shape(list(array.shape), spec, manifest.name, where)
        if array.shape[0] != rows:
            raise InternalError(f"{where} with {array.shape[0]} rows; expected {rows}, one per payload")
        with np.errstate(over="ignore"):  # a value past the input's floats is infinite there: refused just below
            out[spec.name] = np.ascontiguousarray(array, dtype=want)
        _check_finite(out[spec.name], manifest, where)
    return out


def _check_finite(x: np.ndarray, manifest: Manifest, where: str) -> None:
    """A 400 (the payload's: a NaN read from a CSV cell) where ``x`` holds NaN or infinite values the model does not
    accept, as the data plane refuses them in a request's own tensors."""
    if x.dtype.kind != "f" or manifest.allow_nonfinite_inputs or np.isfinite(x).all():
        return
    row = int(np.flatnonzero(~np.isfinite(x).reshape(x.shape[0], -1).all(axis=1))[0])
    raise InvalidInputError(
        f"{where}: row {row} holds a NaN or infinite value (or one beyond the range of {x.dtype.name}); model "
        f"{manifest.name!r} does not accept them (allow_nonfinite_inputs)"
    )


def answers(value: object, count: int) -> list[bytes]:
    """``postprocess``'s answers, each as JSON: a list of ``count``; an :class:`InternalError` naming what came."""
    if not isinstance(value, list | tuple):
        raise InternalError(f"handler postprocess returned {type(value).__name__}; expected a list of {count} answers")
    if len(value) != count:
        raise InternalError(f"handler postprocess returned {len(value)} answers; expected {count}, one per payload")
    out = []
    for i, answer in enumerate(value):
        try:
            out.append(orjson.dumps(answer, option=orjson.OPT_SERIALIZE_NUMPY))
        except TypeError as e:
            raise InternalError(f"handler postprocess answer {i} is not JSON-able: {one_line(e)}") from None
    return out
