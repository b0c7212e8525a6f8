"""A V2 inference request as the named numpy arrays a model takes, whichever protocol carried it: the
:class:`~halfserve.api.dataplane.request.InferRequest` a transport reads from its wire (HTTP's JSON header and binary
data, :mod:`.json_request`; gRPC's ``ModelInferRequest``), its tensors as JSON ``data``, binary data (the binary tensor
extension, see :mod:`halfserve.api.dataplane.codec`), shared memory (the shared memory extension) or texts; every
entry checked against the model's signature (:mod:`.signature`), refused (:class:`~halfserve.errors.InvalidInputError`)
naming the field.

Datatypes. A request's input datatype need not equal the manifest's; it must be able to feed it:

* a floating input (FP32, FP16, BF16, FP64 in the manifest) takes any float or integer datatype, converted to the
  manifest's dtype (float32 for FP32 and BF16 inputs) like ``/predict``'s JSON numbers. BF16 arrives exactly, as
  float32; FP16 stays float16 when the model is served in fp16 (or declares FP16), so the engine's cast is a no-op
  rather than a round trip through float32, and is widened exactly to float32 otherwise, so it can share batches;
* an integer input (INT32, INT64) takes integer datatypes only, range-checked;
* BOOL and BYTES feed nothing; a datatype the protocol does not define is a 400.

FP16 and BF16 data travel only as binary data: JSON has no 16-bit floats, so such JSON ``data`` is a 400, and an
FP16/BF16 output must be requested as binary.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Sequence
from typing import cast

import numpy as np

from halfserve.api.dataplane.bounds import MAX_TIMEOUT_US, check_finite, check_size
from halfserve.api.dataplane.codec import (
    HEADER_LENGTH,
    check_binary_size,
    check_range,
    decode_binary,
    decode_json,
    element_count,
    encode_texts,
    wire_type,
)
from halfserve.api.dataplane.deadline import within
from halfserve.api.dataplane.outputs import check_room, requested_output, requested_outputs
from halfserve.api.dataplane.photos import decode_photos, image_count
from halfserve.api.dataplane.refusals import count
from halfserve.api.dataplane.request import (
    BinaryData,
    Inference,
    InferRequest,
    JsonValues,
    RequestInput,
    SharedMemory,
    Texts,
    flag,
)
from halfserve.api.dataplane.signature import Wording, check_shape
from halfserve.api.dataplane.spans import RegionSource, span
from halfserve.errors import InvalidInputError, OverLimitError
from halfserve.manifest import DataType, Manifest, Precision, TensorSpec, sent_inputs
from halfserve.serving import ModelHandle
from halfserve.settings import Settings


def wrong_datatype(field: str, spec: TensorSpec, wire: DataType, model: str) -> InvalidInputError:
    """The refusal of data of datatype ``wire`` sent to ``spec``, in Triton's words, with the datatypes it does take."""
    kind = spec.datatype.numpy.kind
    takes = "BOOL only" if kind == "b" else "floating or integer data" if kind == "f" else "integer data"
    return InvalidInputError(
        f"{field}: inference input {spec.name!r} data-type is {wire.value!r}, but model {model!r} expects "
        f"{spec.datatype.value!r} (it takes {takes})",
    )


def to_input_dtype(
    arr: np.ndarray, wire: DataType, spec: TensorSpec, fp16_weights: bool, field: str, model: str
) -> np.ndarray:
    """``arr`` (of datatype ``wire``) as the array the batcher takes for ``spec`` of ``model``; the rules are in the
    module's docstring. A binary body's rows stay a read-only view of the body when their dtype is already the
    target's: :meth:`~halfserve.served.ServedModel.submit` copies them for the engine, a front-end into its shared
    slot."""
    target = spec.datatype.numpy
    if target.kind == "b" or wire is DataType.BOOL:
        if not (target.kind == "b" and wire is DataType.BOOL):
            raise wrong_datatype(field, spec, wire, model)
        return arr
    if target.kind == "f":
        if not (wire.is_float or wire.is_integer):
            raise wrong_datatype(field, spec, wire, model)
        if wire is DataType.FP16 and (target == np.float16 or fp16_weights):
            target = np.dtype(np.float16)
    else:
        if not wire.is_integer:
            raise wrong_datatype(field, spec, wire, model)
        check_range(arr, target, field)
    if arr.dtype == target:
        return arr
    # Floats beyond the target's range become infinite here, silently: the finiteness check that follows names them.
    with np.errstate(over="ignore", invalid="ignore"):
        return arr.astype(target, copy=False)


def _input_shape(
    shape: object, spec: TensorSpec, field: str, served: ModelHandle, settings: Settings | None
) -> list[int]:
    """A declared shape, checked to be a list of integers and against ``spec`` (:func:`.signature.check_shape`)."""
    # A list of the spec's dimensions after an integer, the common case, needs no pass over its dimensions.
    if not (type(shape) is list and shape and type(shape[0]) is int and shape[1:] == spec.shape) and (
        not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) for d in shape)
    ):
        raise InvalidInputError(f"{field}: expected a list of integers")
    check_shape(shape, spec, served, settings, field, Wording.V2)
    return shape


def unknown_input(field: str, name: object, served: ModelHandle, specs: list[TensorSpec]) -> InvalidInputError:
    """The refusal of an input the model does not take, in Triton's words, with those it takes."""
    return InvalidInputError(
        f"{field}.name: unexpected inference input {name!r} for model {served.name!r}; "
        f"the model takes {_takes(specs, served.manifest)}",
    )


def _decode_input(
    item: RequestInput,
    field: str,
    served: ModelHandle,
    settings: Settings | None,
    regions: RegionSource | None,
    specs: list[TensorSpec],
) -> tuple[np.ndarray, TensorSpec]:
    """An input of a request (one of ``specs``, the inputs clients send) as the batcher's array, and its spec."""
    spec = next((t for t in specs if t.name == item.name), None)
    if spec is None:
        raise unknown_input(field, item.name, served, specs)
    if item.datatype == "BYTES":  # text (or another string) for an input that takes numbers
        raise InvalidInputError(
            f"{field}.datatype: input {spec.name!r} of model {served.name!r} takes {spec.datatype.value}, not BYTES "
            "(only a model whose manifest declares a text input takes text)",
        )
    wire = wire_type(item.datatype, f"{field}.datatype")
    shape = _input_shape(item.shape, spec, f"{field}.shape", served, settings)
    data = item.data
    if type(data) is BinaryData:
        arr = decode_binary(data.view, wire, shape, data.source or f"{field}.parameters.binary_data_size")
    elif type(data) is SharedMemory:
        where = f"{field}.parameters"
        region = span(regions, item.parameters, where)
        check_binary_size(region.size, wire, shape, f"{where}.shared_memory_byte_size")  # before a byte is read
        # A copy of the client's bytes, so the batcher's array stays as it was read whatever the client does next.
        arr = decode_binary(region.read(), wire, shape, f"{where}.shared_memory_byte_size")
    elif type(data) is JsonValues:
        arr = decode_json(data.values, wire, shape, f"{field}.data")
    else:  # BYTES elements for a datatype that is not BYTES
        raise InvalidInputError(f"{field}.datatype: {wire.value} data cannot be given as BYTES elements")
    # A non-finite value is named where the request held it: the body's binary data, the gRPC field (a
    # raw_input_contents entry, or typed contents) or ``data``; shared memory's refusal keeps the field clients of it
    # have always been given.
    values = (data.source or f"{field} (binary data)") if type(data) is BinaryData else f"{field}.data"
    return checked_input(arr, wire, spec, served, field, values), spec


def checked_input(
    arr: np.ndarray, wire: DataType, spec: TensorSpec, served: ModelHandle, field: str, values: str
) -> np.ndarray:
    """A decoded input entry as the batcher's array for ``spec``: converted to its dtype, checked to be finite (a
    refusal names ``values``, the request field that held them)."""
    x = to_input_dtype(arr, wire, spec, served.precision is Precision.FP16, f"{field}.datatype", served.name)
    check_finite(x, served, values)
    return x


def _takes(specs: list[TensorSpec], manifest: Manifest) -> str:
    """The inputs a client sends, named: a text model's text input too, given instead of the one it feeds."""
    if manifest.text is not None:
        feeds = manifest.text.feeds
        others = [t.name for t in specs if t.name != feeds]
        text = f"text input {manifest.text.input!r} (BYTES, one text per row) or {feeds!r}"
        return text + (f", with {others}" if others else "")
    if manifest.image is not None:
        return f"image input {manifest.image.input!r} (BYTES, one encoded photo per row) or {manifest.image.feeds!r}"
    return f"input {specs[0].name!r}" if len(specs) == 1 else f"inputs {[t.name for t in specs]}"


def check_input_count(given: int, served: ModelHandle, specs: list[TensorSpec] | None = None) -> None:
    """A 400 when a request has more input entries than ``served`` takes (``specs``: its inputs clients send, when
    the caller has them): checked before any is decoded."""
    specs = sent_inputs(served.manifest) if specs is None else specs
    if given > len(specs) + (served.manifest.text is not None or served.manifest.image is not None):
        raise InvalidInputError(
            f"inputs: expected {len(specs)} inputs but got {given} inputs for model {served.name!r}; "
            f"the model takes {_takes(specs, served.manifest)}",
        )


def _names(names: list[str]) -> str:
    """Names as Triton lists them in its messages: ``['INPUT0','INPUT1']``."""
    return "[" + ",".join(f"'{n}'" for n in names) + "]"


def decode(
    req: InferRequest, served: ModelHandle, settings: Settings | None = None, regions: RegionSource | None = None
) -> Inference:
    """Decode a V2 inference request for ``served``, whichever transport read it: every input checked against the
    model's signature, the outputs asked for against its outputs. ``settings`` bounds its size; ``regions`` gives
    the shared memory regions it may name, asked only when it names one."""
    specs = sent_inputs(served.manifest)
    binary_output = flag(req.parameters, "binary_data_output", "parameters", False)
    timeout = count(req.parameters.get("timeout", 0), "parameters.timeout", f"microseconds in [0, {MAX_TIMEOUT_US}]")
    if timeout > MAX_TIMEOUT_US:
        raise InvalidInputError(f"parameters.timeout: expected microseconds in [0, {MAX_TIMEOUT_US}], got {timeout}")
    inputs = req.inputs
    if not inputs:
        raise no_inputs(served, specs)
    check_input_count(len(inputs), served, specs)
    # A text model's texts or an image model's photos, given instead of the input they feed (never both: the first
    # feeds a variable integer input, the second a model's only input, a floating one).
    text = served.manifest.text or served.manifest.image
    tensors: dict[str, np.ndarray] = {}
    pending: tuple[Sequence[bytes | str], str] | None = None  # tokenized or decoded by the caller (tokenize)
    for i, item in enumerate(inputs):
        field = f"inputs[{i}]"
        if text is not None and item.name == text.input:
            photos = served.manifest.image is not None
            texts = _bytes_elements(item, field, served, settings, regions, photos)
            if pending is not None:
                raise InvalidInputError(f"{field}.name: input {text.input!r} is given twice")
            if text.feeds in tensors:
                raise InvalidInputError(f"{field}.name: give {text.input!r} or {text.feeds!r}, not both")
            if settings is None:
                kind = "image" if served.manifest.image is not None else "text"
                raise InvalidInputError(f"{field}: {kind} input is not served here")
            first = next(iter(tensors.items()), None)
            if first is not None and len(texts) != len(first[1]):
                raise InvalidInputError(
                    f"{field}.shape: input {text.input!r} has {len(texts)} rows but {first[0]!r} has {len(first[1])}",
                )
            pending = (texts, field)
            continue
        x, spec = _decode_input(item, field, served, settings, regions, specs)
        if spec.name in tensors:
            raise InvalidInputError(f"{field}.name: input {spec.name!r} is given twice")
        if pending is not None and text is not None and spec.name == text.feeds:  # the same words in either order
            raise InvalidInputError(f"{field}.name: give {text.input!r} or {text.feeds!r}, not both")
        first = next(iter(tensors.items()), None)
        if first is not None and len(x) != len(first[1]):
            raise InvalidInputError(
                f"{field}.shape: input {spec.name!r} has {len(x)} rows but {first[0]!r} has {len(first[1])}"
            )
        if pending is not None and text is not None and len(x) != len(pending[0]):
            raise InvalidInputError(
                f"{field}.shape: input {spec.name!r} has {len(x)} rows but {text.input!r} has {len(pending[0])}"
            )
        tensors[spec.name] = x
    missing = [t.name for t in specs if t.name not in tensors and not (pending and text and t.name == text.feeds)]
    if missing:
        got = [t.name for t in specs if t.name in tensors]
        if text is not None and text.feeds in tensors and any(i.name == text.input for i in inputs):
            got = [text.input if n == text.feeds else n for n in got]
        raise InvalidInputError(
            f"inputs: expected {len(specs)} inputs but got {len(got)} inputs for model {served.name!r}. Got input(s) "
            f"{_names(got)}, but missing required input(s) {_names(missing)}. Please provide all required input(s).",
        )
    rows = len(next(iter(tensors.values()))) if tensors else len(pending[0]) if pending else 0
    if len(served.manifest.outputs) > 1:
        wanted = requested_outputs(req.outputs, binary_output, served.manifest.outputs, regions, served.name)
        for spec in served.manifest.outputs:
            out = wanted.get(spec.name)
            if out is not None and out.span is not None:
                check_room(out.span, spec, rows)
        return _pending(Inference(tensors, req.id, binary_output, timeout, outputs=wanted), pending, served)
    out_spec = served.manifest.outputs[0]
    binary_output, classes, region = requested_output(req.outputs, binary_output, out_spec, regions, served.name)
    if region is not None:
        check_room(region, out_spec, rows)  # checked before the forward: the output's size is known from the rows
    return _pending(Inference(tensors, req.id, binary_output, timeout, classes, region), pending, served)


def no_inputs(served: ModelHandle, specs: list[TensorSpec]) -> InvalidInputError:
    """The refusal of a request that gives no inputs, with those the model takes."""
    return InvalidInputError(f"inputs: expected a non-empty list; the model takes {_takes(specs, served.manifest)}")


async def tokenize(req: Inference, served: ModelHandle, settings: Settings, client: float | None = None) -> Inference:
    """``req`` with its texts (if any) tokenized, or its photos decoded, off the event loop into the inputs they feed
    (:func:`~halfserve.api.dataplane.codec.encode_texts`), within its deadline (``client``'s, the transport's as it was
    on arrival, its own and the model's: :func:`~halfserve.api.dataplane.deadline.within`), what is left of it then
    kept (:attr:`Inference.left`)."""
    if req.texts is None and req.photos is None:
        return req
    _, req.left = await within(served, _decoded(req, served, settings), req.timeout(client))
    return req


async def _decoded(req: Inference, served: ModelHandle, settings: Settings) -> None:
    if req.texts is not None:
        texts, field = req.texts
        req.inputs.update(await encode_texts(texts, field, served, settings))
        req.texts = None
    if req.photos is not None:
        photos, fields = req.photos
        req.inputs.update(await decode_photos(photos, fields, served, settings))
        req.photos = None


def _pending(req: Inference, pending: tuple[Sequence[bytes | str], str] | None, served: ModelHandle) -> Inference:
    """``req`` with the texts or photos :func:`decode` read (``pending``), for :func:`tokenize` to turn into inputs."""
    if pending is None:
        return req
    if served.manifest.image is None:
        req.texts = pending
        return req
    items, field = pending
    req.photos = (cast(list[bytes], list(items)), [f"{field}[{j}]" for j in range(len(items))])
    return req


def _bytes_elements(
    item: RequestInput,
    field: str,
    served: ModelHandle,
    settings: Settings | None,
    regions: RegionSource | None,
    photos: bool,
) -> Sequence[bytes | str]:
    """A ``BYTES`` input of texts, or of encoded photos (``photos``), shape ``[N]`` or ``[N, 1]``, one per row, its
    rows held to their limits before any is read (photos to ``max_request_images`` too): binary data, in the body or
    in shared memory (``regions``, as a tensor's), or BYTES elements as they are; JSON ``data`` as strings, which for
    photos are base64 (a JSON string cannot hold a photo's bytes)."""
    kind, per_row = ("image", "one encoded photo per row") if photos else ("text", "one text per row")
    if item.datatype != "BYTES":
        raise InvalidInputError(f"{field}.datatype: {kind} input {item.name!r} is BYTES, got {item.datatype!r}")
    shape = item.shape
    if not (isinstance(shape, list) and shape and all(type(d) is int for d in shape) and shape[1:] in ([], [1])):
        raise InvalidInputError(f"{field}.shape: expected [N] or [N, 1] ({per_row}), got {shape!r}")
    rows = shape[0]
    if rows < 1:
        raise InvalidInputError(f"{field}.shape: the batch dimension must be at least 1, got {rows}")
    if settings is not None:
        (image_count if photos else check_size)(settings, served, rows, f"{field}.shape")
    data = item.data
    if type(data) is BinaryData:
        return _binary_texts(data.view, rows, shape, data.source or f"{field}.parameters.binary_data_size")
    if type(data) is SharedMemory:
        where = f"{field}.parameters"
        region = span(regions, item.parameters, where)
        most = settings.max_body_bytes if settings is not None else None
        if most is not None and region.size > most:  # refused before a byte is read, as a body that large would be
            raise OverLimitError(
                f"{where}.shared_memory_byte_size: {region.size} bytes, more than the {most} a request's body may "
                "hold (max_body_bytes)"
            )
        return _binary_texts(memoryview(region.read()), rows, shape, f"{where}.shared_memory_byte_size")
    if type(data) is Texts:
        if len(data.items) != rows:
            raise InvalidInputError(f"{field}: {len(data.items)} BYTES elements, but shape {shape} holds {rows}")
        return data.items
    strings = "base64 strings" if photos else "strings"
    values = _unnested(data.values if type(data) is JsonValues else None, shape, f"{field}.data", strings)
    if not isinstance(values, list) or len(values) != rows or not all(isinstance(t, str) for t in values):
        raise InvalidInputError(f"{field}.data: expected {rows} {strings}, {per_row}")
    return [from_base64(v, f"{field}.data[{j}]") for j, v in enumerate(values)] if photos else values


def _unnested(values: object, shape: list[int], field: str, strings: str) -> object:
    """BYTES JSON ``data`` nested as its shape ``[N, 1]`` (row-major, as numbers may be) made flat; flat data as it
    is. Lists nested otherwise are refused naming how they are nested."""
    if not (isinstance(values, list) and any(type(v) is list for v in values)):
        return values
    if len(shape) == 2 and len(values) == shape[0] and all(type(v) is list and len(v) == 1 for v in values):
        return [v[0] for v in values]
    raise InvalidInputError(
        f"{field}: nested lists that do not match shape {shape}; send {shape[0]} {strings} flat, or for shape "
        f"[{shape[0]}, 1] {shape[0]} lists of one each",
    )


_ASCII_WHITESPACE = str.maketrans("", "", "\t\n\f\r ")
"""What base64 may hold between its characters: the line breaks of wrapped base64 (MIME's CRLF every 76, GNU
``base64`` without ``-w0``, Python's ``base64.encodebytes``), which TorchServe's ``VisionHandler`` decodes, and the
rest of the whitespace a browser's ``atob`` skips. Anything else outside the alphabet is refused."""


def from_base64(value: str, field: str) -> bytes:
    """A base64 string's bytes (standard alphabet, padded, ASCII whitespace between its characters ignored), or a
    400 naming ``field``."""
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        pass
    unwrapped = value.translate(_ASCII_WHITESPACE)
    if len(unwrapped) < len(value):
        try:
            return base64.b64decode(unwrapped, validate=True)
        except (binascii.Error, ValueError):
            pass
    raise InvalidInputError(f"{field}: not base64 (standard alphabet, padded)")


def _binary_texts(view: memoryview, rows: int, shape: list[int], field: str) -> list[bytes]:
    """BYTES binary data (each element's 4-byte little-endian length, then the element) as ``rows`` elements, the
    count ``shape`` gives; ``field`` holds the data. A refusal names the element where the data and the shape part:
    reading past the shape's elements would take the bytes of one element as the next one's length."""
    texts: list[bytes] = []
    at, raw = 0, bytes(view)
    size = len(raw)
    while at < size and len(texts) < rows:
        j = len(texts)
        if at + 4 > size:
            raise InvalidInputError(
                f"{field}: BYTES element {j} of shape {shape} ends inside its 4-byte length ({size - at} bytes left)"
            )
        n = int.from_bytes(raw[at : at + 4], "little")
        if at + 4 + n > size:
            raise InvalidInputError(
                f"{field}: BYTES element {j} of shape {shape} declares {n} bytes, but {size - at - 4} bytes follow "
                "its length",
            )
        texts.append(raw[at + 4 : at + 4 + n])
        at += 4 + n
    if len(texts) < rows:
        raise InvalidInputError(f"{field}: {len(texts)} BYTES elements, but shape {shape} holds {rows}")
    if at < size:
        raise InvalidInputError(
            f"{field}: {size - at} bytes follow BYTES element {rows - 1}, the last of the {rows} elements of shape "
            f"{shape} ({at} of the {size} bytes make them); check element {rows - 1}'s 4-byte length",
        )
    return texts


def parse_raw(binary: memoryview, served: ModelHandle, settings: Settings | None = None) -> Inference:
    """A raw binary request (``Inference-Header-Content-Length: 0``): the whole body is the single input's data.

    Its datatype is the manifest's. Since every per-sample dimension is fixed, the batch size follows from the byte
    count: any whole number of samples is accepted (Triton takes exactly one). Outputs are returned as binary.
    """
    if len(served.manifest.inputs) > 1 or served.manifest.inputs[0].variable:
        names = [t.name for t in served.manifest.inputs]
        raise InvalidInputError(
            f"body: a raw binary request ({HEADER_LENGTH}: 0) feeds a model with one fixed-shape input; this one "
            f"takes {names}",
        )
    spec = served.manifest.inputs[0]
    wire = spec.datatype
    sample = element_count(spec.shape) * wire.wire_dtype.itemsize
    if not binary or len(binary) % sample:
        raise InvalidInputError(
            f"body: a raw binary request ({HEADER_LENGTH}: 0) must hold whole samples of {spec.name!r} "
            f"({spec.datatype.value} {spec.shape}: {sample} bytes each), got {len(binary)} bytes",
        )
    shape = [len(binary) // sample, *spec.shape]
    check_shape(shape, spec, served, settings, "body", Wording.V2)
    arr = decode_binary(binary, wire, shape, "body")
    fp16_weights = served.precision is Precision.FP16
    x = to_input_dtype(arr, wire, spec, fp16_weights, "body", served.name)
    check_finite(x, served, "body")
    return Inference({spec.name: x}, None, True)
