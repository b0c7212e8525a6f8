"""A front-end's end of the backplane: the engine process's models as a :class:`~halfserve.serving.ModelService`.

The routes in a front-end decode and validate requests as in a single process, against the model table the engine
process pushes here; :meth:`RemoteModel.submit` hands the named inputs to the engine process instead of to a local
batcher. The engine process stays authoritative: it checks the model and version of every request again, and its
model's ``submit`` refuses what it cannot take now, as in one process.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import orjson

from halfserve.errors import ModelNotReadyError, error_from_wire
from halfserve.execution import Batching
from halfserve.ipc.frames import FrameReader, frame
from halfserve.ipc.memory import Slots
from halfserve.ipc.tensors import from_payload, inline, nbytes
from halfserve.manifest import Manifest, Precision
from halfserve.serving import HandlerPayload, Interface, ModelState, Prediction, Tensors, find, why_model_not_ready
from halfserve.settings import Settings
from halfserve.transport import CoalescedWrites

SLOTS = 128
"""Shared-memory slots per front-end: as many of its requests as can be in flight without inline copies."""
SLOT_BYTES = 2 * 2**20
"""Bytes per slot, enough for a 224x224 RGB image in fp32 (602 KB) with room to spare; memory is committed only
for the slots a front-end has used."""

Answer = Callable[[dict[str, Any], bytearray], Any]
"""Turns an answer frame (header, payload) into the result of the request's future; raises what fails it."""


@dataclass
class _Pending:
    future: asyncio.Future[Any]
    slot: int
    answer: Answer


class BackplaneClient(asyncio.Protocol):
    """A front-end's connection to the engine process, with its shared-memory slots."""

    def __init__(
        self,
        on_table: Callable[[list[dict[str, Any]]], None],
        on_regions: Callable[[list[dict[str, Any]]], None],
        on_lost: Callable[[], None] | None = None,
    ) -> None:
        self.on_table = on_table
        self.on_regions = on_regions
        self.on_lost = on_lost
        """Called when the connection is lost, however it was closed: the engine process gone, or this end closed."""
        self.reader = FrameReader()
        self.transport: asyncio.Transport | None = None
        self.pending: dict[int, _Pending] = {}
        self.ids = itertools.count(1)
        self.records: list[list[Any]] = []
        self.slots, self._fd = Slots.create("halfserve-frontend", SLOTS, SLOT_BYTES)
        self.free = list(range(SLOTS - 1, -1, -1))
        self.table_seen = asyncio.Event()

    async def connect(self, path: str, index: int, secret: str, timeout: float = 60.0) -> None:
        loop = asyncio.get_running_loop()
        deadline = time.monotonic() + timeout
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(path)
                break
            except (FileNotFoundError, ConnectionRefusedError):
                sock.close()
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.05)
        hello = {"index": index, "pid": os.getpid(), "secret": secret}
        hello |= {"slots": SLOTS, "slot_bytes": self.slots.slot_bytes}
        socket.send_fds(sock, [orjson.dumps(hello)], [self._fd])
        os.close(self._fd)
        sock.setblocking(False)
        await loop.connect_accepted_socket(lambda: self, sock=sock)
        await asyncio.wait_for(self.table_seen.wait(), timeout)
        if self.transport is None:
            raise ConnectionError("the engine process closed the backplane connection before sending its table")

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # Requests sent in one iteration go out in one write. (The cast: uvloop's transports are not asyncio's either.)
        self.transport = cast(asyncio.Transport, CoalescedWrites(transport))

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        for p in self.pending.values():
            if not p.future.done():
                p.future.set_exception(ModelNotReadyError("the engine process is gone"))
        self.pending.clear()
        self.table_seen.set()  # a connect() still waiting for the first table raises at once, not at its timeout
        if self.on_lost is not None:
            self.on_lost()

    def data_received(self, data: bytes) -> None:
        for header, payload in self.reader.feed(data):
            rid = header.get("id")
            if "models" in header:  # a pushed table
                self.on_table(header["models"])
                self.on_regions(header["regions"])
                self.table_seen.set()
                if "ack" in header:  # the engine process answers a change once every front-end has it
                    with contextlib.suppress(ModelNotReadyError):
                        self._send({"op": "ack", "ack": header["ack"]})
            if rid is None:
                continue
            pending = self.pending.pop(rid, None)
            if pending is None:
                continue
            try:
                if pending.future.done():  # its caller gave up; the slot is free once the answer is in
                    continue
                try:
                    pending.future.set_result(pending.answer(header, payload))
                except Exception as e:
                    pending.future.set_exception(e)
            finally:
                self._release(pending.slot)

    def _send(self, header: dict[str, Any], *payload: bytes | memoryview) -> None:
        if self.transport is None or self.transport.is_closing():
            raise ModelNotReadyError("the engine process is not connected")
        self.transport.writelines(frame(header, *payload))

    def _release(self, slot: int) -> None:
        if slot >= 0:
            self.free.append(slot)

    def _ask(
        self, header: dict[str, Any], answer: Answer, *payload: bytes | memoryview, slot: int = -1
    ) -> asyncio.Future[Any]:
        """Send a request; the future of its answer. The slot stays taken until the engine process answers, even if
        the caller cancels the future (the engine process may still write into it)."""
        rid = next(self.ids)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.pending[rid] = _Pending(future, slot, answer)
        try:
            self._send({**header, "id": rid}, *payload)
        except ModelNotReadyError:
            del self.pending[rid]
            self._release(slot)
            raise
        return future

    def send(self, model: RemoteModel, inputs: Tensors, timeout: float | None) -> asyncio.Future[Prediction]:
        """Send ``inputs`` to ``model`` in the engine process; the future of its prediction."""
        slot = self.free.pop() if self.free and nbytes(inputs) <= self.slots.slot_bytes else -1
        head = {"op": "infer", "model": model.name, "version": model.version, "timeout": timeout, "slot": slot}
        if slot >= 0:
            head["inputs"] = self.slots.put(slot, inputs)
            return self._ask(head, self._prediction, slot=slot)
        places, parts = inline(inputs)
        head["inputs"] = places
        return self._ask(head, self._prediction, *parts)

    def _prediction(self, header: dict[str, Any], payload: bytearray) -> Prediction:
        error = header.get("error")
        if error is not None:
            raise error_from_wire(error)
        places = header["outputs"]
        if header["slot"] >= 0:
            outputs = {k: v.copy() for k, v in self.slots.take(header["slot"], places).items()}
        else:
            outputs = from_payload(payload, places)
        return Prediction(outputs, tuple(Precision(p) for p in header["precision"].split("+") if p))

    async def publish(self) -> None:
        """Return once every front-end, this one included, has the engine process's table as it is now: after a
        change this front-end relayed (a model loaded, a region registered), before the client is answered."""
        await self._ask({"op": "publish"}, lambda header, payload: None)

    def record(self, row: list[Any]) -> None:
        self.records.append(row)

    def flush(self) -> None:
        if self.records and self.transport is not None:
            records, self.records = self.records, []
            with contextlib.suppress(ModelNotReadyError):
                self._send({"op": "record", "records": records})


@dataclass
class RemoteModel:
    """A model as a front-end knows it: enough to decode its requests; inference runs in the engine process."""

    name: str
    version: int
    manifest: Manifest
    batching: Batching
    state: ModelState
    error: str | None
    precision: Precision | None
    precision_record: dict[str, Any] | None = None
    available: bool = True
    """Whether an instance can run a batch now, as the engine process last said (a table that does not say: yes)."""
    client: BackplaneClient | None = field(default=None, repr=False)

    @property
    def serving(self) -> bool:
        """False for a model unloaded or failed, so that the routes refuse it here as they do in one process; true
        otherwise. The engine process decides the rest (its answer is never stale; a table pushed a moment ago may
        be): a model may have finished loading since. Leaving either state takes a call to the API, which is answered
        only once every front-end has the new table."""
        return self.state not in (ModelState.UNLOADED, ModelState.FAILED)

    def submit(self, inputs: Tensors, timeout: float | None = None) -> asyncio.Future[Prediction]:
        if self.client is None:
            raise ModelNotReadyError("the engine process is not connected")
        return self.client.send(self, inputs, timeout)

    def handle(self, payloads: Sequence[HandlerPayload]) -> None:
        """None: a front-end runs its models' handlers on its own handler threads."""
        return None


class RemoteService:
    """The model table of a front-end, as the engine process last pushed it."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._models: dict[str, RemoteModel] = {}
        self.client: BackplaneClient | None = None

    @property
    def models(self) -> Mapping[str, RemoteModel]:
        return self._models

    @property
    def ready(self) -> bool:
        """As of the last table (readiness itself is answered by the engine process: front-ends relay it)."""
        live = [m for m in self._models.values() if m.state is not ModelState.UNLOADED]
        return bool(live) and all(why_model_not_ready(m) is None for m in live)

    def update(self, models: list[dict[str, Any]]) -> None:
        fresh: dict[str, RemoteModel] = {}
        for m in models:
            old = self._models.get(m["name"])
            if old is not None and old.version == m["version"] and old.precision == _precision(m["precision"]):
                old.state, old.error, old.available = ModelState(m["state"]), m["error"], m.get("available", True)
                old.precision_record = m.get("precision_record")
                fresh[m["name"]] = old  # keep its decoded manifest
                continue
            fresh[m["name"]] = RemoteModel(
                name=m["name"],
                manifest=Manifest.model_validate(m["manifest"]),
                version=m["version"],
                batching=Batching.model_validate(m["batching"]),
                state=ModelState(m["state"]),
                error=m["error"],
                precision=_precision(m["precision"]),
                precision_record=m.get("precision_record"),
                available=m.get("available", True),
                client=self.client,
            )
        self._models = fresh

    def get(self, name: str | None) -> RemoteModel:
        return find(self._models, name)


def _precision(value: str | None) -> Precision | None:
    return Precision(value) if value is not None else None


class RemoteMetrics:
    """Counts a front-end's requests in the engine process's :class:`halfserve.metrics.Metrics`."""

    def __init__(self, client: BackplaneClient) -> None:
        self.client = client

    def request(self, model: str, precision: str, interface: Interface, status: int, rows: int, seconds: float) -> None:
        self.client.record([model, precision, interface.value, status, rows, seconds])
