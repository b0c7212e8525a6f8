"""Which outputs a V2 request wants back, and how each goes: as binary data or JSON, as its top classes (the
classification extension), or into shared memory (the shared memory extension)."""

from __future__ import annotations

from typing import Any

from halfserve.api.dataplane.codec import JSON_UNSUPPORTED, element_count
from halfserve.api.dataplane.refusals import count
from halfserve.api.dataplane.request import OutputRequest, RequestOutput, flag
from halfserve.api.dataplane.spans import RegionSource, Span, span
from halfserve.errors import InvalidInputError
from halfserve.manifest import TensorSpec


def unknown_output(field: str, got: object, model: str, names: list[str]) -> InvalidInputError:
    """The refusal of an output the model does not have, in Triton's words, with those it has."""
    has = repr(names[0]) if len(names) == 1 else str(names)
    return InvalidInputError(
        f"{field}.name: unexpected inference output {got!r} for model {model!r}; the model has {has}"
    )


def _twice(i: int, name: str) -> InvalidInputError:
    """The refusal of entry ``i`` of ``outputs`` naming an output an entry before it names (Triton refuses it too)."""
    return InvalidInputError(f"outputs[{i}].name: output {name!r} is requested twice")


def requested_output(
    requested: list[RequestOutput] | None,
    default: bool,
    out_spec: TensorSpec,
    regions: RegionSource | None,
    model: str,
) -> tuple[bool, int, Span | None]:
    """How the output goes: as binary data or not (its own ``binary_data``, else the request's
    ``binary_data_output``), how many top classes to send instead of it (``classification``; 0 for none), and the
    shared memory it goes to instead of the body (``shared_memory_region``)."""
    binary, classes, region = default, 0, None
    for i, item in enumerate(requested or ()):
        if item.name != out_spec.name:
            raise unknown_output(f"outputs[{i}]", item.name, model, [out_spec.name])
        if i:  # as for a model of several outputs: the second entry would silently override the first
            raise _twice(i, item.name)
        params = item.parameters
        binary, classes = _how(params, i, default)
        if "shared_memory_region" in params:
            field = f"outputs[{i}]"
            if classes:
                raise InvalidInputError(f"{field}.parameters: classification answers in the body, not shared memory")
            region = span(regions, params, f"{field}.parameters")
    if region is not None:
        return False, 0, region
    if not (binary or classes) and out_spec.datatype in JSON_UNSUPPORTED:
        kind = out_spec.datatype.value
        raise InvalidInputError(f"outputs: {out_spec.name!r} is {kind}; JSON has no 16-bit floats, request binary_data")
    return binary, classes, region


def requested_outputs(
    requested: list[RequestOutput] | None,
    default: bool,
    specs: list[TensorSpec],
    regions: RegionSource | None,
    model: str,
) -> dict[str, OutputRequest]:
    """For a model with several outputs: the outputs to return (those ``outputs`` names, else all), each as binary
    data or not (its own ``binary_data``, else the request's ``binary_data_output``), as its top classes
    (``classification``) or into shared memory (``shared_memory_region``)."""
    if requested is None:
        wanted: dict[str, OutputRequest] = {t.name: OutputRequest(default) for t in specs}
    else:
        names = [t.name for t in specs]
        wanted = {}
        for i, item in enumerate(requested):
            got = item.name
            if got not in names:
                raise unknown_output(f"outputs[{i}]", got, model, names)
            if got in wanted:
                raise _twice(i, got)
            params = item.parameters
            out = OutputRequest(*_how(params, i, default))
            if "shared_memory_region" in params:
                field = f"outputs[{i}]"
                if out.classes:
                    raise InvalidInputError(
                        f"{field}.parameters: classification answers in the body, not shared memory"
                    )
                out.span = span(regions, params, f"{field}.parameters")
            wanted[got] = out
    for spec in specs:
        how = wanted.get(spec.name)
        if how is None or how.span is not None or how.classes or how.binary:
            continue
        if spec.datatype in JSON_UNSUPPORTED:
            kind = spec.datatype.value
            raise InvalidInputError(f"outputs: {spec.name!r} is {kind}; JSON has no 16-bit floats, request binary_data")
    return wanted


def _how(params: dict[str, Any], i: int, default: bool) -> tuple[bool, int]:
    """Output ``i``'s ``binary_data`` (``default`` when absent) and ``classification`` (0 when absent)."""
    binary = params.get("binary_data", default)
    classes = params.get("classification", 0)
    if type(binary) is not bool or type(classes) is not int or classes < 0:  # field names formatted only to refuse
        field = f"outputs[{i}].parameters"
        classes = count(classes, f"{field}.classification", "a class count")
        binary = flag(params, "binary_data", field, default)
    return binary, classes


def check_room(region: Span, spec: TensorSpec, rows: int) -> None:
    """A 400 when ``region`` cannot hold ``rows`` rows of output ``spec``: checked before the forward, since the
    output's size is known from the rows."""
    wire = spec.datatype
    need = rows * element_count(spec.shape) * wire.wire_dtype.itemsize
    if need > region.size:
        raise InvalidInputError(
            f"outputs[0].parameters.shared_memory_byte_size: {region.size} bytes cannot hold the output "
            f"{spec.name!r} ({need} bytes for {rows} rows)",
        )
