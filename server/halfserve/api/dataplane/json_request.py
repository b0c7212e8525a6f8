"""A V2 request's JSON header and the binary data after it (the binary tensor extension) as the data plane's typed
:class:`~halfserve.api.dataplane.request.InferRequest`: each input with its own slice of the binary data, cut by its
``binary_data_size``.

Only the header's form is checked here (objects where objects belong, byte counts that the body holds), naming the
field; what the values mean for the model is :func:`~halfserve.api.dataplane.decode.decode`'s to check.
"""

from __future__ import annotations

from halfserve.api.dataplane.codec import HEADER_LENGTH
from halfserve.api.dataplane.decode import no_inputs, unknown_input
from halfserve.api.dataplane.outputs import unknown_output
from halfserve.api.dataplane.refusals import count
from halfserve.api.dataplane.request import (
    SHARED_MEMORY,
    BinaryData,
    InferRequest,
    InputData,
    JsonValues,
    RequestInput,
    RequestOutput,
    parameters,
)
from halfserve.errors import InvalidInputError
from halfserve.manifest import sent_inputs
from halfserve.serving import ModelHandle


def read_request(payload: object, binary: memoryview | None, served: ModelHandle) -> InferRequest:
    """The request of the JSON header ``payload`` and ``binary``, the bytes after it (``None`` when the request has no
    ``Inference-Header-Content-Length`` and so is all JSON), for ``served`` (whose inputs the refusals name)."""
    if not isinstance(payload, dict):
        raise InvalidInputError(f"body: expected a JSON object, got {type(payload).__name__}")
    request_id = payload.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise InvalidInputError(f"id: expected a string, got {type(request_id).__name__}")
    params = payload.get("parameters")
    if type(params) is not dict:
        params = parameters(payload, "parameters")  # {} when absent, else the refusal
    items = payload.get("inputs")
    if not isinstance(items, list) or not items:
        raise no_inputs(served, sent_inputs(served.manifest))
    text = served.manifest.text
    inputs: list[RequestInput] = []
    declared = 0
    # Field names are formatted only for a refusal: this runs for every request whose header has no plan.
    for i, item in enumerate(items):
        if type(item) is not dict:
            raise InvalidInputError(f"inputs[{i}]: expected an object, got {type(item).__name__}")
        name = item.get("name")
        if type(name) is not str:
            raise unknown_input(f"inputs[{i}]", name, served, sent_inputs(served.manifest))
        item_params = item.get("parameters")
        if type(item_params) is not dict:
            item_params = parameters(item, f"inputs[{i}].parameters")
        data = _data(item, item_params, i, binary, declared, text is not None and name == text.input)
        if type(data) is BinaryData:
            declared += len(data.view)
        inputs.append(RequestInput(name, item.get("datatype"), item.get("shape"), item_params, data))
    if binary is not None and len(binary) != declared:
        raise InvalidInputError(
            f"body: {len(binary)} bytes follow the {HEADER_LENGTH} bytes of JSON, "
            f"but the inputs' binary_data_size declare {declared}",
        )
    return InferRequest(request_id, params, inputs, _outputs(payload.get("outputs"), served))


def _data(
    item: dict[str, object], params: dict[str, object], i: int, binary: memoryview | None, taken: int, text: bool
) -> InputData:
    """Where input ``i``'s tensor is: its ``binary_data_size`` bytes of ``binary`` after the ``taken`` bytes of the
    inputs before it, a shared memory region, or its JSON ``data`` (a text input's texts among them)."""
    size = params.get("binary_data_size")
    if "shared_memory_region" in params:
        if size is not None or "data" in item:
            raise InvalidInputError(f"inputs[{i}]: give one of data, binary_data_size or shared_memory_region")
        return SHARED_MEMORY
    if size is None:
        if "data" not in item and not text:
            raise InvalidInputError(f"inputs[{i}]: no tensor data; give data or parameters.binary_data_size")
        return JsonValues(item.get("data"))  # a text input without data: the texts' check names it
    if (
        type(size) is int
        and size >= 0
        and binary is not None
        and size <= len(binary) - taken
        and (text or "data" not in item)
    ):
        return BinaryData(binary[taken : taken + size])
    raise _binary_refusal(item, size, i, binary, taken, text)


def _binary_refusal(
    item: dict[str, object], size: object, i: int, binary: memoryview | None, taken: int, text: bool
) -> InvalidInputError:
    """Why input ``i``'s ``binary_data_size`` of ``size`` is refused: not a byte count, beside ``data``, or more than
    ``binary`` holds after the ``taken`` bytes of the inputs before it."""
    field = f"inputs[{i}]"
    where = f"{field}.parameters.binary_data_size"
    size = count(size, where, "a byte count")
    if text:
        return InvalidInputError(f"{where}: {size} bytes declared, not in the body")
    if "data" in item:
        return InvalidInputError(f"{field}: give either data or parameters.binary_data_size, not both")
    if binary is None:
        return InvalidInputError(f"{where}: binary data needs an {HEADER_LENGTH} header")
    return InvalidInputError(
        f"{where}: inputs declare {size} bytes of binary data, "
        f"but the body has {len(binary) - taken} after the {HEADER_LENGTH} bytes of JSON",
    )


def _outputs(requested: object, served: ModelHandle) -> list[RequestOutput] | None:
    """The ``outputs`` entries, each an object naming an output (whether the model has it is the decoder's check)."""
    if requested is None:
        return None
    if not isinstance(requested, list):
        raise InvalidInputError(f"outputs: expected a list, got {type(requested).__name__}")
    outputs = []
    for i, item in enumerate(requested):
        name = item.get("name") if isinstance(item, dict) else item
        if type(item) is not dict or type(name) is not str:
            raise unknown_output(f"outputs[{i}]", name, served.name, [t.name for t in served.manifest.outputs])
        params = item.get("parameters")
        if type(params) is not dict:
            params = parameters(item, f"outputs[{i}].parameters")
        outputs.append(RequestOutput(name, params))
    return outputs
