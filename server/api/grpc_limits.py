"""What the gRPC port lets a call, a connection and all calls together hold, and the checks on a ``ModelInferRequest``
made before it is parsed.

grpcio's runtime keeps each call's request message until it is whole, so the bounds on what it holds are set where
it has them, as server options (:func:`server_options`): the largest message it accepts (:func:`message_cap`, sized
to the largest request a served model takes rather than to ``max_body_bytes``; a compressed message counts
inflated), calls per connection (``grpc_max_streams``), connections (``max_connections``), how long a connection may
stay idle (``grpc_idle_timeout``), and which compressions it accepts (``grpc_compression``). What it lacks is kept
here (:class:`Admission`): a deadline for each call's request message (``body_timeout``), a process-wide budget of
calls still receiving one (``grpc_pending_bytes``), and a cap on inference calls running at once that the health
checks are not counted in, so no number of silent or slow calls keeps them from answering.

A message is parsed into Python objects all at once, and a small one can describe a great many: 16 MiB of empty
``bytes_contents`` entries is 8 million strings. :func:`check_infer_request` walks the message's encoding first,
counting the repeated entries, and refuses one that holds more than a request to the model it names may take before
anything is built.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import grpc

from server.api.errors import APIError
from server.api.limits import row_limit
from server.manifest import Batching, Manifest, sample_values
from server.settings import Settings

MESSAGE_OVERHEAD = 64 * 1024
"""Bytes a message may hold besides its tensors' data: names, ids, parameters, shapes."""
PROBE_SLOTS = 8
"""Health checks (``grpc.health.v1.Health/Check``, ``ServerLive``, ``ServerReady``) receiving their request at once:
a pool of their own, so calls to other methods cannot use it up."""
PROBES = frozenset({"Check", "ServerLive", "ServerReady"})
MAX_ENTRIES = 4096
"""Most entries of each repeated field of a ``ModelInferRequest`` and of its tensors (inputs, outputs, raw contents,
parameters): far more than any model takes (``server.store.MAX_TENSORS``), so the request's own checks name the
problem, and few enough that parsing them costs little."""
MAX_DIMS = 64
"""Most dimensions a tensor's shape may list."""
INLINE_BYTES = 1 << 20
"""Messages up to this size are checked and parsed on the event loop; larger ones in a worker thread."""

ValueLimit = Callable[[str], tuple[int, str]]
"""Most values one input of a request to the model named may hold, and the setting that decides it."""


def wire_bytes(manifest: Manifest) -> int:
    """Most bytes one row of ``manifest``'s inputs can take in a message: each value in its widest encoding (an
    integer in a typed ``contents`` field is a varint, ten bytes for a negative one), a text at its ``max_bytes``."""
    total = 0
    for spec in manifest.inputs:
        dtype = spec.datatype.numpy
        if dtype.kind == "i":
            per_value = 10
        elif dtype.kind == "u":
            per_value = max(dtype.itemsize, math.ceil(dtype.itemsize * 8 / 7))
        else:
            per_value = dtype.itemsize
        total += math.prod(spec.bounded()) * per_value
    if manifest.text is not None:
        total += manifest.text.max_bytes + 16  # a length prefix and the entry's tag
    return total


def message_cap(settings: Settings, models: Iterable[tuple[Manifest, Batching]]) -> int:
    """The largest gRPC message the server accepts: what the largest request any of ``models`` takes can need (its
    most rows, each input value at its widest, and :data:`MESSAGE_OVERHEAD`), never more than ``max_body_bytes``."""
    largest = 0
    for manifest, batching in models:
        rows, _ = row_limit(settings, batching)
        rows = min(rows, max(1, settings.max_request_elements // max(sample_values(manifest), 1)))
        largest = max(largest, rows * wire_bytes(manifest))
    return min(settings.max_body_bytes, largest + MESSAGE_OVERHEAD)


def server_options(settings: Settings, cap: int) -> list[tuple[str, int]]:
    """grpcio's server options for ``settings`` and a message cap of ``cap`` bytes."""
    identity, deflate, gzip = 1, 2, 4  # grpc_compression_algorithm's bits
    return [
        ("grpc.max_receive_message_length", cap),
        ("grpc.max_metadata_size", settings.max_header_bytes),
        ("grpc.server_handshake_timeout_ms", round(settings.header_timeout * 1000)),
        ("grpc.max_concurrent_streams", settings.grpc_max_streams),
        ("grpc.max_allowed_incoming_connections", settings.max_connections),
        ("grpc.max_connection_idle_ms", round(settings.grpc_idle_timeout * 1000)),
        ("grpc.compression_enabled_algorithms_bitset", identity | (deflate | gzip if settings.grpc_compression else 0)),
        ("grpc.so_reuseport", 0),
    ]


class Admission:
    """The calls of one gRPC server: those receiving a request message, and the inference calls running."""

    def __init__(self, settings: Settings, cap: int) -> None:
        self.cap = cap
        self.slots = max(1, settings.grpc_pending_bytes // cap)
        """Calls that may be receiving a request message at once: each may hold up to ``cap`` bytes meanwhile."""
        self.receiving = 0
        self.probes_receiving = 0
        self.max_calls = settings.max_connections
        self.calls = 0
        self.settings = settings

    async def receive(self, context: grpc.aio.ServicerContext, *, probe: bool, stream: bool = False) -> bytes | None:
        """The call's next request message as it came (None where its stream ended instead), refused when the
        budget of calls receiving one is spent, and when a unary call's does not arrive whole within
        ``body_timeout``."""
        if probe:
            if self.probes_receiving >= PROBE_SLOTS:
                raise APIError(429, f"server busy: {PROBE_SLOTS} health checks are receiving their request")
            self.probes_receiving += 1
        else:
            if self.receiving >= self.slots:
                raise APIError(
                    429,
                    f"server busy: {self.receiving} calls are receiving their request message, each up to "
                    f"{self.cap} bytes (grpc_pending_bytes: {self.settings.grpc_pending_bytes})",
                )
            self.receiving += 1
        try:
            if stream:  # a stream's wait between requests is bounded by its caller, who knows when it is idle
                raw = await context.read()
            else:
                timeout = self.settings.body_timeout
                try:
                    raw = await asyncio.wait_for(context.read(), timeout)
                except TimeoutError:
                    raise APIError(
                        408, f"request message: not received whole within {timeout:g} s (body_timeout)"
                    ) from None
        finally:
            if probe:
                self.probes_receiving -= 1
            else:
                self.receiving -= 1
        if raw is grpc.aio.EOF:
            return None
        assert isinstance(raw, bytes)
        return raw

    @contextlib.contextmanager
    def inference(self) -> Iterator[None]:
        """One inference call running (``ModelInfer``, or a ``ModelStreamInfer`` stream): one past
        ``max_connections`` is refused."""
        if self.calls >= self.max_calls:
            raise APIError(429, f"server busy: {self.calls} inference calls in progress (max_connections)")
        self.calls += 1
        try:
            yield
        finally:
            self.calls -= 1


async def parse(raw: bytes, message: Any, name: str, values: ValueLimit | None = None) -> Any:
    """``raw`` parsed as ``message`` (a class), a 400 naming ``name`` where it is not one; a ``ModelInferRequest``
    (``values`` given) checked by :func:`check_infer_request` first. A large message in a worker thread."""
    if len(raw) <= INLINE_BYTES:
        return _parse(raw, message, name, values)
    return await asyncio.to_thread(_parse, raw, message, name, values)


def _parse(raw: bytes, message: Any, name: str, values: ValueLimit | None) -> Any:
    if values is not None:
        check_infer_request(raw, values)
    try:
        return message.FromString(raw)
    except Exception as e:  # protobuf's DecodeError, or a message nested too deep
        raise APIError(400, f"request: not a valid {name} message ({e})") from None


# The encoding of a ModelInferRequest ---------------------------------------------------------------------------------

_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5
_MALFORMED = "request: not a valid ModelInferRequest message"


def _varint(buf: bytes, pos: int, end: int) -> tuple[int, int]:
    result = shift = 0
    while pos < end and shift < 70:
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos
        shift += 7
    raise APIError(400, _MALFORMED)


def _fields(buf: bytes, start: int, end: int) -> Iterator[tuple[int, int, int, int]]:
    """Each field of the message in ``buf[start:end]``: its number, wire type, and where its value starts and ends."""
    pos = start
    while pos < end:
        key, pos = _varint(buf, pos, end)
        number, wire = key >> 3, key & 7
        if wire == _VARINT:
            value_start = pos
            _, pos = _varint(buf, pos, end)
        elif wire == _LEN:
            length, value_start = _varint(buf, pos, end)
            pos = value_start + length
        elif wire in (_I64, _I32):
            value_start = pos
            pos += 8 if wire == _I64 else 4
        else:
            raise APIError(400, _MALFORMED)
        if pos > end:
            raise APIError(400, _MALFORMED)
        yield number, wire, value_start, pos


def _varints(buf: bytes, start: int, end: int) -> int:
    """How many varints a packed field's ``buf[start:end]`` holds: its bytes without the continuation bit."""
    return (end - start) - len(buf[start:end].translate(None, bytes(range(128))))


def _count(counts: dict[int, int], number: int, field: str, limit: int = MAX_ENTRIES) -> None:
    counts[number] = counts.get(number, 0) + 1
    if counts[number] > limit:
        raise APIError(400, f"{field}: more than {limit} entries")


def check_infer_request(raw: bytes, values: ValueLimit) -> None:
    """Refuse a ``ModelInferRequest`` encoding with more entries than any request takes, counted before it is parsed:
    more than :data:`MAX_ENTRIES` inputs, outputs, ``raw_input_contents`` or parameters, more than :data:`MAX_DIMS`
    dimensions in a shape, an input's ``contents`` given twice (protobuf would merge them) or holding more values
    than its shape or ``values`` of the model named allows. Values are not looked at: the request's own checks do
    that once parsed."""
    model = ""
    for number, wire, start, end in _fields(raw, 0, len(raw)):
        if number == 1 and wire == _LEN:  # model_name, wherever it is: the last one is the one parsed
            model = raw[start:end].decode("utf-8", "replace")
    allowed = values(model)
    counts: dict[int, int] = {}
    for number, wire, start, end in _fields(raw, 0, len(raw)):
        _count(counts, number if number in _NAMES else 0, _NAMES.get(number, "request: fields"))
        if number == 5 and wire == _LEN:
            _check_input(raw, start, end, f"inputs[{counts[5] - 1}]", allowed)
        elif number == 6 and wire == _LEN:
            parameters: dict[int, int] = {}
            for n, _, _, _ in _fields(raw, start, end):
                _count(parameters, n, f"outputs[{counts[6] - 1}].{'parameters' if n == 2 else 'fields'}")


_NAMES = {4: "parameters", 5: "inputs", 6: "outputs", 7: "raw_input_contents"}
"""The repeated fields of a ``ModelInferRequest`` (the map of parameters is one too), by field number."""


def _check_input(raw: bytes, start: int, end: int, field: str, limit: tuple[int, str]) -> None:
    dims: list[int] = []
    contents: tuple[int, int] | None = None
    others: dict[int, int] = {}
    for number, wire, s, e in _fields(raw, start, end):
        if number == 3:
            if wire == _LEN:
                if len(dims) + _varints(raw, s, e) > MAX_DIMS:
                    raise APIError(400, f"{field}.shape: more than {MAX_DIMS} dimensions")
                pos = s
                while pos < e:
                    value, pos = _varint(raw, pos, e)
                    dims.append(value)
            else:
                value, _ = _varint(raw, s, e)
                dims.append(value)
            if len(dims) > MAX_DIMS:
                raise APIError(400, f"{field}.shape: more than {MAX_DIMS} dimensions")
        elif number == 5 and wire == _LEN:
            if contents is not None:  # merged, the two would hold more values than either is counted at
                raise APIError(400, f"{field}.contents: given more than once")
            contents = (s, e)
        else:
            _count(others, number, f"{field}.{'parameters' if number == 4 else 'fields'}")
    if contents is None:
        return
    # Negative dimensions are the shape check's to name; here they allow nothing.
    signed = [d - (1 << 64) if d >= 1 << 63 else d for d in dims]
    holds = math.prod(max(d, 0) for d in signed) if dims else 0
    most, setting = limit
    allowed = min(holds, most)
    values = 0
    for number, wire, s, e in _fields(raw, *contents):
        # bytes_contents: a value per entry; the numbers' fields are packed (a run of values) or not (one each)
        values += _packed_count(raw, number, s, e) if wire == _LEN and number != 8 else 1
        if values > allowed:
            name = f"{field}.contents.{_CONTENTS.get(number, 'fields')}"
            if allowed < holds:
                raise APIError(
                    413,
                    f"{name}: more values than the limit of {allowed} per request ({setting})",
                )
            raise APIError(400, f"{name}: more than {holds} values, but shape {signed} holds {holds}")


_CONTENTS = dict(
    enumerate(
        [
            "",
            "bool_contents",
            "int_contents",
            "int64_contents",
            "uint_contents",
            "uint64_contents",
            "fp32_contents",
            "fp64_contents",
            "bytes_contents",
        ]
    )
)
"""The fields of ``InferTensorContents`` by number."""
_FIXED = {6: 4, 7: 8}
"""Bytes per value of the packed fixed-size fields of ``InferTensorContents`` (fp32, fp64); the others are varints."""


def _packed_count(raw: bytes, number: int, start: int, end: int) -> int:
    width = _FIXED.get(number)
    return (end - start) // width if width else _varints(raw, start, end)
