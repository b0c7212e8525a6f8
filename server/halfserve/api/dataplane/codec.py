"""Tensors on the wire, as numpy arrays: ``/predict``'s JSON samples and KServe V2's datatype names, JSON ``data``
and binary tensor data extension. A manifest's datatype maps onto the arrays the batcher takes by
:attr:`halfserve.manifest.DataType.numpy`, the one such map.

Binary tensor data is little-endian, row-major and unpadded, in the datatype's native size; it follows the JSON
header in the body, whose length the ``Inference-Header-Content-Length`` header gives. Everything here is numpy:
bytes become arrays through ``np.frombuffer``, never a per-element Python loop.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from contextvars import ContextVar
from typing import Any

import numpy as np

from halfserve import text
from halfserve.api.dataplane.bounds import JSON_LITERALS
from halfserve.errors import InvalidInputError, ModelNotReadyError, OverLimitError, QueueFullError
from halfserve.manifest import DataType, TensorSpec
from halfserve.packing import PackError, check_length
from halfserve.serving import ModelHandle
from halfserve.settings import Settings

COMPRESSED_BYTES: ContextVar[int | None] = ContextVar("halfserve_compressed_bytes", default=None)
"""The compressed size of the body the transport last inflated for the request being answered
(:func:`halfserve.api.http.limits.read_body`; None: it came uncompressed): the text it carries is held to
``max_compression_ratio`` times it too, as tokenizing is work its inflated bytes buy (a body's first MiB inflates
freely, and 16 texts of 65,000 ``!`` gzip to about a kilobyte)."""

HEADER_LENGTH = "Inference-Header-Content-Length"
"""The binary tensor extension's header: the byte length of the JSON object at the start of the body."""


# In the protocol's own order, as a refusal lists them.
_BY_NAME: dict[str, DataType] = {
    name: DataType(name)
    for name in ("BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64", "FP16", "FP32")
    + ("FP64", "BF16")
}

JSON_UNSUPPORTED = frozenset({DataType.FP16, DataType.BF16})
"""Datatypes JSON cannot carry faithfully: the protocol sends them only as binary data."""


def wire_type(name: object, field: str) -> DataType:
    """The datatype called ``name``, or a 400 naming ``field`` and the datatypes known."""
    if not isinstance(name, str):
        raise InvalidInputError(f"{field}: expected a datatype string, got {type(name).__name__}")
    wire = _BY_NAME.get(name)
    if wire is None:
        known = ", ".join(_BY_NAME)
        hint = " (string tensors are not served)" if name == "BYTES" else ""
        raise InvalidInputError(f"{field}: unknown datatype {name!r}{hint}; known: {known}")
    return wire


def split_body(body: bytes, header_length: str | None) -> tuple[bytes | None, memoryview | None]:
    """Split a request body into its JSON header and the binary tensor data after it.

    Without the header the whole body is JSON (binary ``None``). A header of 0 means a raw binary request: no JSON
    at all (``None``), the whole body is the binary data of the model's single input.
    """
    if header_length is None:
        return body, None
    text = header_length.strip()
    # Past 18 digits no length can be right, and int() of over 4,300 digits raises (CPython's conversion limit).
    if not (text.isascii() and text.isdigit() and len(text) <= 18):
        raise InvalidInputError(f"{HEADER_LENGTH}: expected a non-negative integer, got {header_length!r}")
    n = int(text)
    if n == 0:
        return None, memoryview(body)
    if n > len(body):
        raise InvalidInputError(f"{HEADER_LENGTH}: {n} exceeds the body's {len(body)} bytes")
    view = memoryview(body)
    return bytes(view[:n]), view[n:]


def element_count(shape: list[int]) -> int:
    return math.prod(shape)


def check_binary_size(size: int, wire: DataType, shape: list[int], field: str) -> None:
    """Refuse ``size`` bytes of binary data for a tensor of ``shape`` and ``wire`` that takes another number."""
    want = element_count(shape) * wire.wire_dtype.itemsize
    if size != want:
        raise InvalidInputError(
            f"{field}: {size} bytes of binary data, but shape {shape} of {wire.value} takes {want} bytes"
        )


def decode_binary(buf: memoryview | bytes | bytearray, wire: DataType, shape: list[int], field: str) -> np.ndarray:
    """``buf`` as an array of ``shape``; BF16 is widened to float32 exactly (its bits are float32's top half).

    The result may be a read-only view of ``buf``.
    """
    check_binary_size(len(buf), wire, shape, field)
    arr = np.frombuffer(buf, dtype=wire.wire_dtype)
    if wire is DataType.BF16:
        arr = (arr.astype(np.uint32) << 16).view(np.float32)
    return arr.reshape(shape)


def decode_json(data: object, wire: DataType, shape: list[int], field: str) -> np.ndarray:
    """JSON ``data`` (flat, row-major, or nested exactly as ``shape``) as an array of ``wire``'s dtype."""
    if wire in JSON_UNSUPPORTED:
        raise InvalidInputError(
            f"{field}: {wire.value} data cannot travel as JSON (JSON has no 16-bit floats); "
            "send it as binary data (binary tensor extension: parameters.binary_data_size)",
        )
    if not isinstance(data, list):
        raise InvalidInputError(f"{field}: expected a list, got {type(data).__name__}")
    try:
        # Without a dtype numpy keeps strings and None as such, so they are caught below instead of coerced.
        arr = np.asarray(data)
    except ValueError:
        raise InvalidInputError(f"{field}: nested lists of unequal length") from None
    if wire is DataType.BOOL:
        if arr.dtype.kind != "b" and arr.size:
            raise InvalidInputError(f"{field}: BOOL data must be true/false")
    elif arr.dtype.kind not in "iuf" and arr.size:
        raise InvalidInputError(f"{field}: values must be numbers, got {_kind_name(arr)}")
    else:
        refuse_booleans(data, arr, f"{field}: {wire.value} data must be numbers")
        if wire.is_integer and arr.dtype.kind == "f":
            exact = exact_integers(data, arr, floats=False, field=field)
            if exact is None:
                # Integers past int64 (2^63, -2^63 - 1) come out of numpy as floats: whole, they are out of range.
                if arr.size and np.array_equal(arr, np.trunc(arr)) and not _fits(arr, wire.wire_dtype):
                    raise InvalidInputError(f"{field}: values beyond the range of {wire.value}")
                raise InvalidInputError(f"{field}: {wire.value} data must be integers")
            arr = exact
    if arr.size != element_count(shape):
        raise InvalidInputError(f"{field}: {arr.size} values, but shape {shape} holds {element_count(shape)}")
    if arr.ndim > 1 and list(arr.shape) != shape:
        raise InvalidInputError(
            f"{field}: nested as {list(arr.shape)}, but shape is {shape}; nest as shape or send flat"
        )
    if wire.is_integer:
        check_range(arr, wire.wire_dtype, field)
    try:
        # JSON numbers are finite: the cast is where one could overflow (1e39 as FP32).
        with np.errstate(over="raise", invalid="raise"):
            return arr.astype(wire.wire_dtype).reshape(shape)
    except FloatingPointError:
        raise InvalidInputError(f"{field}: values beyond the range of {wire.value}") from None


def check_range(arr: np.ndarray, dtype: np.dtype[Any], field: str) -> None:
    """Fail with a 400 when integers in ``arr`` do not fit ``dtype``."""
    if not arr.size or arr.dtype.kind not in "iu" or np.can_cast(arr.dtype, dtype, "safe"):
        return  # nothing to check, or every value of its dtype fits (UINT8 bytes for a UINT8 input: no pass over them)
    info = np.iinfo(dtype)
    lo, hi = int(arr.min()), int(arr.max())
    if lo < info.min or hi > info.max:
        raise InvalidInputError(f"{field}: values in [{lo}, {hi}] do not fit {dtype.name}")


def to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 values as bfloat16 bit patterns (uint16), rounded to nearest even; NaN stays a quiet NaN."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    bits = ((u + (0x7FFF + ((u >> 16) & 1))) >> 16).astype("<u2")
    nan = np.isnan(x)
    if nan.any():
        bits[nan] = 0x7FC0
    return bits


def wire_values(arr: np.ndarray, wire: DataType) -> np.ndarray:
    """Output values (float32 from the engine) in ``wire``'s dtype: integers are rounded, BF16 gives its bits."""
    if wire is DataType.BF16:
        return to_bf16_bits(arr)
    if arr.dtype == wire.wire_dtype and arr.flags.c_contiguous:
        return arr
    # An output beyond the datatype's range (an FP16 output over 65504, an infinite one as an integer) is cast as
    # numpy casts it, without a warning per response.
    with np.errstate(over="ignore", invalid="ignore"):
        if wire.is_integer and arr.dtype.kind == "f":
            arr = np.rint(arr)
        return np.ascontiguousarray(arr, dtype=wire.wire_dtype)


def encode_binary(arr: np.ndarray, wire: DataType) -> bytes:
    """``arr`` as the binary tensor data of ``wire``."""
    return wire_values(arr, wire).tobytes()


def encode_bytes(items: list[bytes]) -> bytes:
    """``BYTES`` elements as binary tensor data: each one's length (4 bytes, little-endian), then the element."""
    return b"".join(len(b).to_bytes(4, "little") + b for b in items)


def checked_length(spec: TensorSpec, length: int, field: str) -> None:
    """A 400 naming ``field``, the input and its ``max_length`` when a variable input of ``length`` is too long (and
    not cut with ``truncate``)."""
    try:
        check_length(spec, length, f"{field}: input {spec.name!r}")
    except PackError as e:
        raise InvalidInputError(str(e)) from None


async def encode_texts(
    texts: Sequence[bytes | str], field: str, served: ModelHandle, settings: Settings
) -> dict[str, np.ndarray]:
    """A request's texts as the named inputs the model takes (token ids and each row's length), tokenized with the
    version's tokenizer off the event loop; a 413 naming ``field`` when they carry more than ``max_text_bytes`` (or
    than ``max_compression_ratio`` times the compressed body they came in), a
    400 naming the row for a text it cannot take, a 503 when the server cannot tokenize (its tokenizer file missing
    or unreadable), a 503 with ``Retry-After`` when more requests wait to be tokenized than the queue holds."""
    max_text_bytes = settings.max_text_bytes
    if text.text_bytes(texts, max_text_bytes) > max_text_bytes:
        raise OverLimitError(f"{field}: texts of more than {max_text_bytes} bytes in one request (max_text_bytes)")
    compressed = COMPRESSED_BYTES.get()
    inflated = max_text_bytes if compressed is None else int(settings.max_compression_ratio * compressed)
    if inflated < max_text_bytes and text.text_bytes(texts, inflated) > inflated:
        raise OverLimitError(
            f"{field}: texts of more than {inflated} bytes from a body of {compressed} compressed bytes "
            f"(max_compression_ratio: {settings.max_compression_ratio:g})",
        )
    try:
        return await text.encode_off_loop(settings.store, served.name, served.version, served.manifest, texts, field)
    except text.TokenizerUnavailableError as e:  # the server's files, not the request: as a missing checkpoint
        raise ModelNotReadyError(f"model {served.name!r} cannot take text now: {e}", retry=False) from None
    except text.TokenizerBusyError as e:  # as a full batch queue
        raise QueueFullError(str(e)) from None
    except text.TextError as e:
        raise InvalidInputError(str(e)) from None


def decode_samples(samples: Any, spec: TensorSpec, field: str = "inputs") -> np.ndarray:
    """A JSON list of samples (each a nested list of the per-sample shape) as one array, rows first, in ``spec``'s
    dtype; its shape is for :func:`~halfserve.api.dataplane.signature.check_shape` to check against ``spec``.

    Raises :class:`~halfserve.errors.InvalidInputError` naming ``field`` when the list is empty, ragged or
    non-numeric.
    """
    if not isinstance(samples, list):
        raise InvalidInputError(f"{field}: expected a list of samples, got {type(samples).__name__}")
    if not samples:
        raise InvalidInputError(f"{field}: empty; send at least one sample")
    try:
        # Without a dtype numpy keeps strings and None as such, so they are caught below instead of coerced.
        arr = np.asarray(samples)
    except ValueError:
        also = "; the samples of one request share a length (send others in another request)" if spec.variable else ""
        raise InvalidInputError(f"{field}: samples are ragged (nested lists of unequal length){also}") from None
    if spec.datatype.numpy.kind == "b":
        if arr.dtype.kind != "b":
            raise InvalidInputError(f"{field}: the {spec.name!r} input takes true or false, got {_kind_name(arr)}")
        return arr
    if arr.dtype.kind not in "iuf":
        raise InvalidInputError(f"{field}: values must be numbers, got {_kind_name(arr)}")
    refuse_booleans(samples, arr, f"{field}: the {spec.name!r} input takes numbers ({spec.datatype.value})")
    if spec.datatype.numpy.kind in "iu" and arr.dtype.kind == "f":
        exact = exact_integers(samples, arr, floats=True, field=field)
        arr = arr if exact is None else exact
    return cast_json_numbers(arr, spec.datatype.numpy, field)


def refuse_booleans(data: Any, arr: np.ndarray, wanted: str) -> None:
    """A 400 (``wanted``, then what came) where JSON ``data``, numbers as numpy read them (``arr``), holds a ``true``
    or ``false``: numpy reads one beside numbers as 1 or 0 (a token id 1), and alone as booleans, which are refused as
    not numbers. Only where the body may hold one (:data:`~halfserve.api.dataplane.bounds.JSON_LITERALS`): the look
    is at every value's type."""
    if arr.size and JSON_LITERALS.get() and bool in map(type, np.asarray(data, dtype=object).ravel()):
        raise InvalidInputError(f"{wanted}, got true or false")


def exact_integers(data: list[Any], arr: np.ndarray, floats: bool, field: str) -> np.ndarray | None:
    """The whole numbers of JSON ``data`` that numpy read as floats (``arr``), read exactly, for an integer input.

    numpy reads a list as float64 where integers past int64 are mixed with others (``[1, 2**64 - 1]``), or integers
    with floats (``[1.0, 2**60 + 1]``), and float64 rounds integers past 2^53: UINT64's largest became 2^64 and was
    refused as out of range, 2^60 + 1 became 2^60. Here they are int64, or uint64 where that holds them all.

    None where float64 is exact (no value past 2^53), where some value is not a whole number (or is a float at all,
    unless ``floats``: V2's integer data takes none), or where no 64-bit type holds them all: the caller refuses those
    or takes the floats. A float past 2^53 was already rounded by the parser (-2^63 - 1 to -2^63): beside one, an
    integer past 2^53 cannot be read exactly, and is refused naming ``field`` rather than rounded.
    """
    if not arr.size or float(np.abs(arr).max()) < 2.0**53:
        return None
    values = np.asarray(data, dtype=object).ravel().tolist()
    if floats:
        if not all(isinstance(v, int) or (type(v) is float and v.is_integer()) for v in values):
            return None  # a fraction: refused as one
        if any(type(v) is float and abs(v) >= 2.0**53 for v in values):
            if any(isinstance(v, int) and abs(v) > 2**53 for v in values):
                raise InvalidInputError(
                    f"{field}: integers past 2^53 beside floats past it cannot all be read exactly; send every value "
                    "as an integer (no decimal point or exponent)"
                )
            return None  # floats alone: as float64 holds them
        values = [int(v) for v in values]
    elif not all(type(v) is int for v in values):
        return None
    low, high = min(values), max(values)
    if low >= -(2**63) and high < 2**63:
        return np.array(values, dtype=np.int64).reshape(arr.shape)
    if low >= 0 and high < 2**64:
        return np.array(values, dtype=np.uint64).reshape(arr.shape)
    return None


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
            raise InvalidInputError(f"{field}: the input takes integers ({dtype.name}), got fractional values")
        elif arr.size and not _fits(arr, dtype):
            raise InvalidInputError(f"{field}: values beyond the range of {dtype.name}")
        return arr.astype(dtype, copy=False)
    try:
        with np.errstate(over="raise", invalid="raise"):
            return arr.astype(dtype, copy=False)
    except FloatingPointError:
        raise InvalidInputError(f"{field}: values beyond the range of {dtype.name}") from None


def _fits(arr: np.ndarray, dtype: np.dtype[Any]) -> bool:
    """Whether whole floats ``arr`` fit integer ``dtype``, bounds compared exactly: int64's largest, 2^63 - 1, is
    2^63 as a float, so ``max <= iinfo.max`` let 2^63 through, and the cast wrapped it to -2^63. int64's least as a
    float is refused too: JSON's -2^63 - 1 is parsed as that float (past int64, the parser rounds to a float), and the
    least itself, an integer, never reaches here."""
    info = np.iinfo(dtype)
    low = float(int(info.min))
    above_low = arr.min() > low if info.bits == 64 and info.min < 0 else arr.min() >= low
    return bool(above_low and arr.max() < float(int(info.max) + 1))


def _kind_name(arr: np.ndarray) -> str:
    return {"b": "booleans", "U": "strings", "S": "bytes", "O": "non-numeric values (null or mixed)"}.get(
        arr.dtype.kind, str(arr.dtype)
    )
