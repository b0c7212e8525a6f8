"""A tensor's shape against its input in the model's signature, for ``/predict`` and V2 (HTTP and gRPC) alike: one
rule, so that a change to it holds for every protocol; each protocol only words the refusal its own way
(:class:`Wording`), naming its own field.

The rule: rows first, then the input's per-sample shape; at least one row; a variable first dimension at least 1
long and no longer than the input's ``max_length`` (unless cut with ``truncate``); no more rows and values than one
request may carry (:func:`~halfserve.api.dataplane.bounds.check_size`).
"""

from __future__ import annotations

from enum import Enum

from halfserve.api.dataplane.bounds import check_size
from halfserve.api.dataplane.codec import checked_length
from halfserve.errors import InvalidInputError
from halfserve.manifest import TensorSpec
from halfserve.serving import ModelHandle
from halfserve.settings import Settings


class Wording(Enum):
    """How a protocol speaks of a tensor's shape in its refusals."""

    V2 = "v2"
    """The whole tensor, batch first, in Triton's words (``Expected [-1,16], got [1,3]``)."""
    SAMPLES = "samples"
    """``/predict``'s: a list of samples, each of the per-sample shape."""


def check_shape(
    dims: list[int],
    spec: TensorSpec,
    served: ModelHandle,
    settings: Settings | None,
    field: str,
    wording: Wording,
) -> None:
    """Refuse a tensor of shape ``dims`` (rows first) for input ``spec`` of ``served``, naming ``field``, unless it
    keeps the rule in the module's docstring (the rows' limits only with ``settings``)."""
    if not (dims and dims[0] >= 1 and dims[1:] == spec.shape):  # the common case, a fixed shape, checked first
        if spec.variable and len(dims) == len(spec.shape) + 1 and dims[2:] == spec.shape[1:]:
            if dims[0] < 1 or dims[1] < 1:
                raise _empty(dims, field, wording, variable=True)
            checked_length(spec, dims[1], field)
        elif len(dims) != len(spec.shape) + 1 or dims[1:] != spec.shape:
            raise _wrong_shape(dims, spec, served, field, wording)
        else:
            raise _empty(dims, field, wording, variable=False)
    if settings is not None:
        check_size(settings, served, dims[0], field)


def _empty(dims: list[int], field: str, wording: Wording, variable: bool) -> InvalidInputError:
    """The refusal of a tensor with no rows, or of a variable input's with no length."""
    if wording is Wording.SAMPLES:
        if dims[0] < 1:
            return InvalidInputError(f"{field}: empty; send at least one sample")
        return InvalidInputError(f"{field}: each sample must be at least 1 long, got {dims[1]}")
    if variable:
        return InvalidInputError(f"{field}: the batch and length dimensions must be at least 1, got {dims}")
    return InvalidInputError(f"{field}: the batch dimension must be at least 1, got {dims[0]}")


def _wrong_shape(
    dims: list[int], spec: TensorSpec, served: ModelHandle, field: str, wording: Wording
) -> InvalidInputError:
    if wording is Wording.SAMPLES:
        got = dims[1:] if len(dims) > 1 else "a scalar"
        return InvalidInputError(f"{field}: each sample must have shape {spec.shape}, got {got}")
    per_sample = ", ".join("L" if d == -1 else str(d) for d in spec.shape)
    return InvalidInputError(
        f"{field}: unexpected shape for input {spec.name!r} for model {served.name!r}. "
        f"Expected {dims_text([-1, *spec.shape])}, got {dims_text(dims)}: send [N, {per_sample}] (batch first)",
    )


def dims_text(shape: list[int]) -> str:
    """A shape as Triton writes one in its messages: ``[-1,3,224,224]``."""
    return "[" + ",".join(str(d) for d in shape) + "]"
