"""The outputs ``halfserve import`` derives from what a model's forward returned for :data:`ROWS` rows, and what it
leaves out, each with why.

A tensor is ``output``; a tuple's entries are ``output0``, ``output1``...; a mapping's (a Hugging Face
``ModelOutput``) keep their names. Every tensor of one row per input row is kept, integer and boolean ones too, of
shape ``[]`` where it holds one value per row (a regression's ``[B]``, an ``argmax``). What cannot be served (a loss
of one value for the batch, something not a tensor, a dtype no manifest declares) is named with the reason, so that
the import can say what clients will not get rather than drop it without a word.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch
from pydantic import ValidationError

from halfserve.manifest import MAX_TENSORS, TENSOR_NAME, DataType, TensorSpec, describe
from halfserve.outputcheck import ROWS

DTYPES = {
    torch.float32: DataType.FP32,
    torch.float16: DataType.FP32,
    torch.bfloat16: DataType.FP32,
    torch.float64: DataType.FP64,
    torch.int64: DataType.INT64,
    torch.int32: DataType.INT32,
    torch.uint8: DataType.UINT8,
    torch.bool: DataType.BOOL,
}
"""The datatype an output of each torch dtype is declared as (half-precision floats are served widened to FP32)."""


class NothingServableError(ValueError):
    """A forward that returned no output the server can serve; the message says what it returned instead."""


def derive(y: object) -> tuple[list[TensorSpec], list[str]]:
    """The outputs of a forward that returned ``y`` for :data:`ROWS` rows, and what it returned that they leave out,
    each as ``name (why)`` (see the module)."""
    if isinstance(y, torch.Tensor):
        named: dict[str, object] = {"output": y}
    elif isinstance(y, Mapping):  # ModelOutput is an OrderedDict
        named = {str(k): v for k, v in y.items()}
    elif isinstance(y, tuple | list):
        named = {f"output{i}": v for i, v in enumerate(y)}
    else:
        raise NothingServableError(f"the model returned {type(y).__name__}")
    specs: list[TensorSpec] = []
    dropped: list[str] = []
    names = list(named)
    for i, (name, value) in enumerate(named.items()):
        spec_or_why = _spec(name, value)
        if isinstance(spec_or_why, TensorSpec):
            specs.append(spec_or_why)
            continue
        dropped.append(f"{name} ({spec_or_why})")
        if isinstance(y, tuple | list):  # served by position: nothing after an entry that cannot be
            dropped += [f"{n} (after {name}: a tuple's outputs are served by position)" for n in names[i + 1 :]]
            break
    if len(specs) > MAX_TENSORS:
        dropped += [f"{t.name} (a model serves {MAX_TENSORS} outputs at most)" for t in specs[MAX_TENSORS:]]
        specs = specs[:MAX_TENSORS]
    if not specs:
        raise NothingServableError(f"the model returned no tensor the server can serve: {'; '.join(dropped)}")
    return specs, dropped


def _spec(name: str, value: object) -> TensorSpec | str:
    """The output ``name`` as the manifest declares it, or why it cannot be served."""
    if not isinstance(value, torch.Tensor):
        return f"{'None' if value is None else type(value).__name__}, not a tensor"
    if value.ndim == 0 or value.shape[0] != ROWS:
        got = "one value" if value.ndim == 0 else f"shape {list(value.shape)}"
        return f"{got} for {ROWS} input rows, not one row per input row"
    dtype = str(value.dtype).removeprefix("torch.")
    if value.dtype not in DTYPES:
        served = ", ".join(str(d).removeprefix("torch.") for d in DTYPES)
        return f"dtype {dtype}, not one the server returns ({served}): cast it in the forward"
    if not re.fullmatch(TENSOR_NAME, name):
        return "not a name an output may have: a letter or _, then letters, digits, _, . or -"
    try:
        return TensorSpec(name=name, datatype=DTYPES[value.dtype], shape=list(value.shape[1:]))
    except ValidationError as e:  # rows of no values ([B, 0]), or too many
        return f"rows of shape {list(value.shape[1:])}: {describe(e)}"
