"""The engine process's end of the backplane: front-ends connect, say hello, and send requests to its models."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import mmap
import os
import secrets
import socket
from collections.abc import Callable
from typing import Any, cast

import orjson

from halfserve import manifest as store
from halfserve.errors import ModelNotReadyError, error_to_wire
from halfserve.instance import pin_host
from halfserve.ipc import exports
from halfserve.ipc.frames import FrameReader, frame
from halfserve.ipc.memory import Slots
from halfserve.ipc.tensors import from_payload, inline, nbytes
from halfserve.metrics import Metrics
from halfserve.packing import LENGTH
from halfserve.regions import Regions
from halfserve.repository import ModelRepository
from halfserve.serving import Interface, Prediction, Tensors
from halfserve.transport import CoalescedWrites

log = logging.getLogger(__name__)

TABLE_POLL_S = 0.05
"""How often the engine process looks for model changes (loads, unloads, precision switches) to push."""
PUBLISH_TIMEOUT_S = 5.0
"""How long a change made through the API (a region registered, a model loaded) waits for every front-end to say it
has the new table before it is answered anyway; a front-end that does not answer in time is logged."""
HELLO_BYTES = 4096
HELLO_TIMEOUT_S = 5.0
"""How long a new connection has to send its hello before it is dropped."""


def table(repo: ModelRepository) -> list[dict[str, Any]]:
    """What a front-end needs of each model to decode its requests."""
    return [
        {
            "name": s.name,
            "version": s.version,
            "state": s.state.value,
            "available": s.available,
            "error": s.error,
            "precision": s.precision.value if s.precision is not None else None,
            "precision_record": s.precision_record,
            "manifest": s.manifest.model_dump(mode="json"),
            "batching": s.batching.model_dump(mode="json"),
        }
        for s in repo.models.values()
    ]


def _signature(repo: ModelRepository, regions: Regions) -> tuple[object, ...]:
    models = tuple(
        (
            s.name,
            s.version,
            s.state,
            s.available,
            s.precision,
            id(s.manifest),
            s.batcher is None,
            id(s.precision_record),
        )
        for s in repo.models.values()
    )
    return models, regions.generation


class HelloRefused(Exception):
    """A connection's hello was late, malformed or not from one of this run's front-ends."""


class _Connection(asyncio.Protocol):
    """One front-end's connection, on the engine process's event loop."""

    def __init__(self, backplane: Backplane, slots: Slots, release: Callable[[], None] | None = None) -> None:
        self.backplane = backplane
        self.slots = slots
        self.release = release
        self.reader = FrameReader()
        self.transport: asyncio.Transport | None = None
        self.pending: set[asyncio.Future[Prediction]] = set()
        """Requests queued or running, answered from a callback when done (no task per request)."""
        self.acks: dict[int, asyncio.Future[None]] = {}
        """Tables pushed by :meth:`Backplane.publish` that this front-end has yet to say it applied, by number."""
        self.publishing: set[asyncio.Task[None]] = set()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A batch's answers go out in one write. (The cast: uvloop's transports are not asyncio's subclasses either.)
        self.transport = cast(asyncio.Transport, CoalescedWrites(transport))
        self.send({"op": "table", **self.backplane.table()})

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.backplane.connections.discard(self)
        for ack in self.acks.values():  # a front-end that is gone serves no request with an old table
            if not ack.done():
                ack.set_result(None)
        for task in self.publishing:
            task.cancel()
        for f in list(self.pending):
            f.cancel()  # rows not yet running are withdrawn
            f.add_done_callback(self._release)
        self._release()

    def _release(self, _: object = None) -> None:
        """Release the front-end's memory (unpinned, withdrawn from instance processes) once it is gone and none of
        its requests is left running."""
        if self.transport is None and not self.pending and self.release is not None:
            self.release()
            self.release = None

    def send(self, header: dict[str, Any], *payload: bytes | memoryview) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.writelines(frame(header, *payload))

    def data_received(self, data: bytes) -> None:
        for header, payload in self.reader.feed(data):
            op = header.get("op")
            if op == "infer":
                self._infer(header, payload)
            elif op == "record":
                self.backplane.record(header["records"])
            elif op == "ack":
                ack = self.acks.get(header["ack"])
                if ack is not None and not ack.done():
                    ack.set_result(None)
            elif op == "publish":
                task = asyncio.create_task(self._publish(header["id"]), name="backplane-publish")
                self.publishing.add(task)
                task.add_done_callback(self.publishing.discard)

    async def _publish(self, rid: int) -> None:
        """Answer a front-end that relayed a change once every front-end has the table as it is now."""
        await self.backplane.publish()
        self.send({"id": rid})

    def _infer(self, head: dict[str, Any], payload: bytearray) -> None:
        try:
            served = self.backplane.repo.get(head["model"])
            if head["version"] != served.version:
                raise ModelNotReadyError(f"model {served.name!r} was reloaded as version {served.version}; retry")
            # Readiness as in one process: the route checked its own rule (V2's names the version asked for) on the
            # front-end's table, and submit refuses a model that cannot take the request now, saying why.
            future = served.submit(self._inputs(store.sent_inputs(served.manifest), head, payload), head.get("timeout"))
        except Exception as e:
            self._fail(head["id"], e)
            return
        self.pending.add(future)
        future.add_done_callback(functools.partial(self._answer, head["id"], head["slot"]))

    def _answer(self, rid: int, slot: int, future: asyncio.Future[Prediction]) -> None:
        self.pending.discard(future)
        if future.cancelled():  # the front-end is gone
            return
        error = future.exception()
        if error is not None:
            self._fail(rid, error)
            return
        result = future.result()
        reply: dict[str, Any] = {"id": rid, "precision": result.precision}
        if slot >= 0 and nbytes(result.outputs) <= self.slots.slot_bytes:
            self.send({**reply, "slot": slot, "outputs": self.slots.put(slot, result.outputs)})
        else:
            places, parts = inline(result.outputs)
            self.send({**reply, "slot": -1, "outputs": places}, *parts)

    def _fail(self, rid: int, e: BaseException) -> None:
        self.send({"id": rid, "error": error_to_wire(e)})

    def _inputs(self, specs: list[Any], head: dict[str, Any], payload: bytearray) -> Tensors:
        """The request's named inputs: views of its slot (or of the payload), checked against the model's signature
        as it is now."""
        places = head["inputs"]
        tensors = self.slots.take(head["slot"], places) if head["slot"] >= 0 else from_payload(payload, places)
        # Each row's length of a variable input travels beside it (tokenized texts); the packing checks it.
        changed = len([n for n in tensors if not n.endswith(LENGTH)]) != len(specs)
        for spec in specs:
            x = tensors.get(spec.name)
            if x is None:
                changed = True
            elif spec.variable:
                changed = changed or x.ndim != len(spec.shape) + 1 or list(x.shape[2:]) != spec.shape[1:]
            else:
                changed = changed or list(x.shape[1:]) != spec.shape
        if changed:
            raise ModelNotReadyError(f"model {head['model']!r} changed its inputs while this request was decoded")
        return tensors


class Backplane:
    """The engine process's end: accepts front-ends on a Unix socket and serves their requests from ``repo``."""

    def __init__(
        self,
        path: str,
        repo: ModelRepository,
        metrics: Metrics,
        expected: int,
        regions: Regions,
        secret: str,
        on_hello: Callable[[int], None] | None = None,
    ) -> None:
        self.path = path
        self.secret = secret
        """The run's secret (:attr:`Frontends.secret`): a hello without it is dropped."""
        self.on_hello = on_hello
        """Told the pid of each front-end welcomed: the supervisor tells a front-end that failed to start from one
        that ran."""
        self.expected = expected
        """Front-ends the server runs: until that many are connected, readiness answers no."""
        self.repo = repo
        self.regions = regions
        """Client shared memory regions: front-ends map them too, since they decode and encode tensors."""
        self.metrics = metrics
        self.connections: set[_Connection] = set()
        self._listener: socket.socket | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._hellos: set[asyncio.Task[None]] = set()
        self._numbers = itertools.count(1)

    async def start(self) -> None:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(self.path)
        listener.listen(64)
        listener.setblocking(False)
        self._listener = listener
        self._tasks = [
            asyncio.create_task(self._accept(listener), name="backplane-accept"),
            asyncio.create_task(self._watch(), name="backplane-watch"),
        ]

    async def _accept(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            conn, _ = await loop.sock_accept(listener)
            # Each hello on its own: a connection that says nothing holds up no other front-end's (re)connect.
            task = asyncio.create_task(self._welcome(conn), name="backplane-hello")
            self._hellos.add(task)
            task.add_done_callback(self._hellos.discard)

    async def _welcome(self, conn: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        try:
            hello, fd = await self._hello(conn)
            memory, release = await loop.run_in_executor(None, self._open_slots, hello, fd)
        except (HelloRefused, OSError, ValueError, TypeError, KeyError) as e:
            log.warning("a connection to the backplane was dropped: %s", e)
            conn.close()
            return
        connection = _Connection(self, Slots(memory, hello["slot_bytes"]), release)
        self.connections.add(connection)
        await loop.connect_accepted_socket(lambda: connection, sock=conn)
        if self.on_hello is not None and isinstance(hello.get("pid"), int):
            self.on_hello(hello["pid"])
        log.info("front-end %s (pid %s) connected", hello.get("index"), hello.get("pid"))

    async def _hello(self, conn: socket.socket) -> tuple[dict[str, Any], int]:
        """A front-end's hello (its index, pid, the run's secret, its slots) and its memfd, within
        :data:`HELLO_TIMEOUT_S`. asyncio's transports cannot receive descriptors, so the hello is read with
        ``recvmsg`` once the socket is readable."""
        loop = asyncio.get_running_loop()
        readable = loop.create_future()

        def ready() -> None:
            if not readable.done():
                readable.set_result(None)

        loop.add_reader(conn.fileno(), ready)
        try:
            await asyncio.wait_for(readable, HELLO_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise HelloRefused(f"no hello within {HELLO_TIMEOUT_S:g} s") from None
        finally:
            loop.remove_reader(conn.fileno())
        msg, fds, _, _ = socket.recv_fds(conn, HELLO_BYTES, 1)
        try:
            hello = orjson.loads(msg)
            given = hello.get("secret", "") if isinstance(hello, dict) else ""
            if not isinstance(given, str) or not secrets.compare_digest(given.encode(), self.secret.encode()):
                raise HelloRefused("the hello does not carry this run's secret")
            slots, slot_bytes = hello["slots"], hello["slot_bytes"]
            if not (isinstance(slots, int) and isinstance(slot_bytes, int) and 0 < slots * slot_bytes <= 2**34):
                raise HelloRefused(f"a hello asking for {slots!r} slots of {slot_bytes!r} bytes")
            if len(fds) != 1:
                raise HelloRefused(f"a hello with {len(fds)} descriptors, not one")
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        conn.setblocking(False)
        return hello, fds[0]

    def _open_slots(self, hello: dict[str, Any], fd: int) -> tuple[mmap.mmap, Callable[[], None]]:
        """Map a front-end's memfd and, on a CUDA engine, page-lock it, so that batches copy its slots straight to
        the device (about 0.1 ms per image less on the instance's thread); returns it and the function that releases
        it once the front-end is gone and none of its requests runs."""
        try:
            memory = mmap.mmap(fd, hello["slots"] * hello["slot_bytes"])
            # Instance processes read its slots where they are, too (halfserve.ipc.exports).
            withdraw = exports.export(memory, fd)
        finally:
            os.close(fd)
        unpin = pin_host(memory) if self.repo.device.type == "cuda" else None
        if self.repo.device.type == "cuda" and unpin is None:
            log.warning("front-end %s: shared memory not page-locked; batches stage it", hello.get("index"))

        def release() -> None:
            withdraw()
            if unpin is not None:
                unpin()

        return memory, release

    def table(self) -> dict[str, Any]:
        """What front-ends mirror: the model table and the shared memory regions."""
        return {"models": table(self.repo), "regions": self.regions.status()}

    async def publish(self) -> None:
        """Push the table to every front-end, and return once each has applied it (or :data:`PUBLISH_TIMEOUT_S`
        passed).

        A change made through the API (a region registered or unregistered, a model loaded or unloaded) is answered
        only after this, so that the client's next request finds it whichever front-end takes it. The table pushed
        every :data:`TABLE_POLL_S` covers changes that come from nowhere in particular (a model that finishes
        loading)."""
        loop = asyncio.get_running_loop()
        number = next(self._numbers)
        message = {"op": "table", "ack": number, **self.table()}
        waiting: dict[asyncio.Future[None], _Connection] = {}
        for c in list(self.connections):
            if c.transport is None:
                continue  # not yet connected: it is sent the table as it is when it connects
            ack: asyncio.Future[None] = loop.create_future()
            c.acks[number] = ack
            waiting[ack] = c
            c.send(message)
        try:
            if waiting:
                _, late = await asyncio.wait(waiting, timeout=PUBLISH_TIMEOUT_S)
                if late:
                    log.warning("%d front-end(s) did not apply a new table within %g s", len(late), PUBLISH_TIMEOUT_S)
        finally:
            for c in waiting.values():
                c.acks.pop(number, None)

    async def _watch(self) -> None:
        """Push the table to every front-end when a model or a region changes."""
        seen = _signature(self.repo, self.regions)
        while True:
            await asyncio.sleep(TABLE_POLL_S)
            now = _signature(self.repo, self.regions)
            if now != seen:
                seen = now
                message = {"op": "table", **self.table()}
                for c in list(self.connections):
                    c.send(message)

    def record(self, records: list[list[Any]]) -> None:
        """Count front-ends' requests: ``[model, precision, interface, status, rows, seconds]`` each."""
        for model, precision, interface, status, rows, seconds in records:
            self.metrics.request(model, precision, Interface(interface), status, rows, seconds)

    def missing(self) -> str | None:
        """What readiness waits for until every front-end is connected; None once they all are."""
        if len(self.connections) >= self.expected:
            return None
        return f"HTTP front-ends ({len(self.connections)} of {self.expected} connected)"

    async def close(self) -> None:
        tasks = [*self._tasks, *self._hellos]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        for c in list(self.connections):
            if c.transport is not None:
                c.transport.close()
        if self._listener is not None:
            self._listener.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
