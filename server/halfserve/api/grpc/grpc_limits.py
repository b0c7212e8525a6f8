"""What the gRPC port lets a call, a connection and all calls together hold, and the checks on a ``ModelInferRequest``
made before it is parsed.

grpcio's runtime keeps each call's request message until it is whole, so the bounds on what it holds are set where
it has them, as server options (:func:`server_options`): the largest message it accepts (:func:`message_cap`, sized
to the largest request a served model takes rather than to ``max_body_bytes``; a compressed message counts
inflated), calls per connection (``grpc_max_streams``), connections (``max_connections``), how long a connection may
stay without a call (``header_timeout``), and which compressions it accepts (``grpc_compression``). What it lacks is
kept here (:class:`Admission`): a deadline for each call's request message (``body_timeout``), a process-wide budget
of calls still receiving one (``grpc_pending_bytes``) of which one client address holds a share
(``grpc_peer_share``) and a late call gives its slot up (``grpc_receive_grace``, :class:`Slots`), and a cap on
inference calls running at once that the health checks are not counted in, so no number of silent or slow calls
keeps them from answering.

A message is parsed into Python objects all at once, and a small one can describe a great many: 16 MiB of empty
``bytes_contents`` entries is 8 million strings. :func:`check_infer_request` walks the message's encoding first,
counting the repeated entries, and refuses one that holds more than a request to the model it names may take before
anything is built.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc

from halfserve import storage
from halfserve.api.dataplane.bounds import row_limit
from halfserve.api.dataplane.refusals import Refusal
from halfserve.api.errors import RefusedError
from halfserve.execution import Batching
from halfserve.manifest import Manifest, load_manifest, sample_values
from halfserve.settings import Settings
from halfserve.storage import StoreError

MESSAGE_OVERHEAD = 64 * 1024
"""Bytes a message may hold besides its tensors' data: names, ids, parameters, shapes."""
PROBE_SLOTS = 8
"""Health checks (``grpc.health.v1.Health/Check``, ``ServerLive``, ``ServerReady``) receiving their request at once:
a pool of their own, so calls to other methods cannot use it up."""
PROBE_TIMEOUT = 1.0
"""Seconds a health check's request message may take to arrive (a probe's is a few bytes, sent with its call)."""
PROBES = frozenset({"Check", "ServerLive", "ServerReady"})
MAX_ENTRIES = 4096
"""Most entries of each repeated field of a ``ModelInferRequest`` and of its tensors (inputs, outputs, raw contents,
parameters): far more than any model takes (``halfserve.manifest.MAX_TENSORS``), so the request's own checks name the
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


def store_models(settings: Settings, served: Iterable[tuple[Manifest, Batching]]) -> list[tuple[Manifest, Batching]]:
    """``served``, and every other model whose manifest the store holds and reads at start: grpcio's message limit is
    set once, so it is sized for a model loaded later through the repository API too (one ``--models`` left out, or
    one unloaded), which would otherwise take over HTTP requests that gRPC refuses."""
    models = list(served)
    read = {manifest.name for manifest, _ in models}
    with contextlib.suppress(StoreError, OSError):
        for name in storage.model_folders(settings.store):
            if name in read:
                continue  # served: its manifest is read already, and its batching is the one in force
            with contextlib.suppress(StoreError, OSError, ValueError):
                manifest = load_manifest(settings.store / name)
                models.append((manifest, manifest.batching))
    return models


def server_options(settings: Settings, cap: int) -> list[tuple[str, int]]:
    """grpcio's server options for ``settings`` and a message cap of ``cap`` bytes."""
    identity, deflate, gzip = 1, 2, 4  # grpc_compression_algorithm's bits
    return [
        ("grpc.max_receive_message_length", cap),
        ("grpc.max_metadata_size", settings.max_header_bytes),
        ("grpc.server_handshake_timeout_ms", round(settings.header_timeout * 1000)),
        ("grpc.max_concurrent_streams", settings.grpc_max_streams),
        ("grpc.max_allowed_incoming_connections", settings.max_connections),
        # Counted from a connection's start too: one that makes no call is closed as soon as one between calls.
        ("grpc.max_connection_idle_ms", round(min(settings.header_timeout, settings.grpc_idle_timeout) * 1000)),
        ("grpc.compression_enabled_algorithms_bitset", identity | (deflate | gzip if settings.grpc_compression else 0)),
        ("grpc.so_reuseport", 0),
    ]


@dataclass(eq=False)
class _Holder:
    """One call waiting for a request message, in the slot it holds."""

    peer: str
    since: float
    evicted: asyncio.Future[None]


class Slots:
    """Calls that may wait for a request message at once, at most ``per_peer`` of them from one client address.

    A call holds its slot from its start, as grpcio shows no byte of a message before all of it: a silent call and a
    slow one look the same. So a call that has waited ``grace`` seconds gives its slot up to a call that needs one:
    a client's message arrives with its call's headers, so only a silent or trickling call is that late, and it
    keeps its slot (up to its own deadline) only while nobody else needs it."""

    def __init__(self, slots: int, per_peer: int, grace: float, what: str, share: str) -> None:
        self.slots, self.per_peer, self.grace, self.what, self.share = slots, per_peer, grace, what, share
        self.held = 0
        self.by_peer: dict[str, list[_Holder]] = {}
        """Each client address's calls holding a slot, the longest waiting first."""

    def claim(self, peer: str) -> _Holder:
        """A slot for a call from ``peer``, another call's taken where that one is late, or refused as too many."""
        mine = self.by_peer.get(peer, [])
        if len(mine) >= self.per_peer:
            self._evict(mine, f"{len(mine)} calls from {peer} are {self.what} ({self.share}: {self.per_peer})")
        elif self.held >= self.slots:
            # The late call of the client holding the most slots goes first: a client filling the slots with
            # silent calls loses its own before anyone else's.
            by_count = sorted(self.by_peer.values(), key=len, reverse=True)
            self._evict([h for held in by_count for h in held], f"{self.held} calls are {self.what}")
        holder = _Holder(peer, time.monotonic(), asyncio.get_running_loop().create_future())
        self.by_peer.setdefault(peer, []).append(holder)
        self.held += 1
        return holder

    def _evict(self, candidates: list[_Holder], busy: str) -> None:
        now = time.monotonic()
        for h in candidates:  # in order: the first late one goes
            if now - h.since >= self.grace:
                self.release(h)
                h.evicted.set_result(None)
                return
        raise RefusedError(Refusal.TOO_MANY, f"server busy: {busy}")

    def release(self, holder: _Holder) -> None:
        held = self.by_peer.get(holder.peer, [])
        if holder in held:  # an evicted call's slot is released already
            held.remove(holder)
            self.held -= 1
            if not held:
                del self.by_peer[holder.peer]


class Admission:
    """The calls of one gRPC server: those receiving a request message, and the inference calls running."""

    def __init__(self, settings: Settings, cap: int) -> None:
        self.cap = cap
        slots = max(1, settings.grpc_pending_bytes // cap)
        per_peer = max(1, math.floor(slots * settings.grpc_peer_share))
        budget = f"receiving their request message, each up to {cap} bytes (grpc_pending_bytes: {slots} calls)"
        self.receiving = Slots(slots, per_peer, settings.grpc_receive_grace, budget, "grpc_peer_share")
        """Calls that may be receiving a request message at once: each may hold up to ``cap`` bytes meanwhile."""
        self.probes = Slots(PROBE_SLOTS, PROBE_SLOTS, 0.0, "health checks receiving their request", "all")
        """A health check's message is a few bytes that come with its call: any one still waiting is late."""
        self.max_calls = settings.max_connections
        self.calls = 0
        self.settings = settings

    async def receive(
        self, context: grpc.aio.ServicerContext, peer: str, *, probe: bool, stream: bool = False
    ) -> bytes | None:
        """The call's next request message as it came (None where its stream ended instead), refused when the
        calls from ``peer`` (a client address) or all calls receiving one hold every slot and none is late, and when
        a unary call's does not arrive whole within ``body_timeout`` (a health check's: :data:`PROBE_TIMEOUT`), or
        a late call's slot is given to another call."""
        slots = self.probes if probe else self.receiving
        holder = slots.claim(peer)
        reading = asyncio.ensure_future(context.read())
        try:
            timeout = self._deadline(probe=probe, stream=stream)
            await asyncio.wait({reading, holder.evicted}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            if reading.done():
                raw = reading.result()
            elif holder.evicted.done():
                raise RefusedError(
                    Refusal.TOO_SLOW,
                    f"request message: not received within {slots.grace:g} s, and another call needed its slot "
                    f"({'health checks' if probe else 'grpc_receive_grace'})",
                )
            else:
                assert timeout is not None
                what = "" if probe else " (body_timeout)"
                raise RefusedError(Refusal.TOO_SLOW, f"request message: not received whole within {timeout:g} s{what}")
        finally:
            reading.cancel()
            slots.release(holder)
        if raw is grpc.aio.EOF:
            return None
        assert isinstance(raw, bytes)
        return raw

    def _deadline(self, *, probe: bool, stream: bool) -> float | None:
        if stream:  # a stream's wait between requests is bounded by its caller, who knows when it is idle
            return None
        return min(PROBE_TIMEOUT, self.settings.body_timeout) if probe else self.settings.body_timeout

    @contextlib.contextmanager
    def inference(self) -> Iterator[None]:
        """One inference call running (``ModelInfer``, or a ``ModelStreamInfer`` stream): one past
        ``max_connections`` is refused."""
        if self.calls >= self.max_calls:
            raise RefusedError(
                Refusal.TOO_MANY, f"server busy: {self.calls} inference calls in progress (max_connections)"
            )
        self.calls += 1
        try:
            yield
        finally:
            self.calls -= 1


async def parse(raw: bytes, message: Any, name: str, values: ValueLimit | None = None) -> Any:
    """``raw`` parsed as ``message`` (a class), refused as invalid naming ``name`` where it is not one; a
    ``ModelInferRequest`` (``values`` given) checked by :func:`check_infer_request` first. A large message in a worker
    thread."""
    if len(raw) <= INLINE_BYTES:
        return _parse(raw, message, name, values)
    return await asyncio.to_thread(_parse, raw, message, name, values)


def _parse(raw: bytes, message: Any, name: str, values: ValueLimit | None) -> Any:
    if values is not None:
        check_infer_request(raw, values)
    try:
        return message.FromString(raw)
    except Exception as e:  # protobuf's DecodeError, or a message nested too deep
        raise RefusedError(Refusal.INVALID, f"request: not a valid {name} message ({e})") from None


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
    raise RefusedError(Refusal.INVALID, _MALFORMED)


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
            raise RefusedError(Refusal.INVALID, _MALFORMED)
        if pos > end:
            raise RefusedError(Refusal.INVALID, _MALFORMED)
        yield number, wire, value_start, pos


def _varints(buf: bytes, start: int, end: int) -> int:
    """How many varints a packed field's ``buf[start:end]`` holds: its bytes without the continuation bit."""
    return (end - start) - len(buf[start:end].translate(None, bytes(range(128))))


def _count(counts: dict[int, int], number: int, field: str, limit: int = MAX_ENTRIES) -> None:
    counts[number] = counts.get(number, 0) + 1
    if counts[number] > limit:
        raise RefusedError(Refusal.INVALID, f"{field}: more than {limit} entries")


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
                    raise RefusedError(Refusal.INVALID, f"{field}.shape: more than {MAX_DIMS} dimensions")
                pos = s
                while pos < e:
                    value, pos = _varint(raw, pos, e)
                    dims.append(value)
            else:
                value, _ = _varint(raw, s, e)
                dims.append(value)
            if len(dims) > MAX_DIMS:
                raise RefusedError(Refusal.INVALID, f"{field}.shape: more than {MAX_DIMS} dimensions")
        elif number == 5 and wire == _LEN:
            if contents is not None:  # merged, the two would hold more values than either is counted at
                raise RefusedError(Refusal.INVALID, f"{field}.contents: given more than once")
            contents = (s, e)
        else:
            _count(others, number, f"{field}.{'parameters' if number == 4 else 'fields'}")
    if contents is None:
        return
    # Negative dimensions are the shape check's to name; here they allow nothing.
    signed = [d - (1 << 64) if d >= 1 << 63 else d for d in dims]
    # A shape of no dimensions holds one value, as over HTTP: the decoder refuses it as HTTP's does (no batch dim).
    holds = math.prod(max(d, 0) for d in signed)
    most, setting = limit
    allowed = min(holds, most)
    values = 0
    for number, wire, s, e in _fields(raw, *contents):
        # bytes_contents: a value per entry; the numbers' fields are packed (a run of values) or not (one each)
        values += _packed_count(raw, number, s, e) if wire == _LEN and number != 8 else 1
        if values > allowed:
            name = f"{field}.contents.{_CONTENTS.get(number, 'fields')}"
            if allowed < holds:
                raise RefusedError(
                    Refusal.TOO_LARGE,
                    f"{name}: more values than the limit of {allowed} per request ({setting})",
                )
            raise RefusedError(Refusal.INVALID, f"{name}: more than {holds} values, but shape {signed} holds {holds}")


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
