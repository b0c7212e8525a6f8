"""The backplane: how HTTP front-end processes hand inference requests to the process that owns the engines.

With ``--http-workers N`` (N > 1) the server runs N front-end processes that accept the clients' connections, parse
and validate requests and encode the answers, and one engine process that owns the models, batches every front-end's
requests together and runs them on the device. One Python process parses HTTP at a few thousand requests per second
(profiled: about 250 us of event-loop time per 150 KB image request on a 16-core host); a GPU forward at batch 64
takes a fraction of that per row, so on a GPU host the event loop, not the device, is the limit without this.

Each front-end holds one Unix-socket connection to the engine process and one shared-memory segment (a ``memfd``,
sent over that socket with ``SCM_RIGHTS``, so it needs no ``/dev/shm`` space and leaves no file behind), cut into
slots. A request's input is copied once into a free slot; the engine process batches a numpy view of it (no copy),
writes the output rows into the same slot and answers with their dtype and shape. Inputs or outputs larger than a slot
travel inline on the socket instead. Frames are ``<II`` (header length, payload length), an orjson header, then the
payload; a connection's requests are answered out of order, by id.

The engine process stays authoritative: it checks the model, version and readiness of every request itself, so a
front-end's copy of the model table (pushed to it within :data:`TABLE_POLL_S` of any change) only has to be recent
enough to decode requests. Front-ends send the per-request metrics (status, rows, latency) here in batches, so
``/metrics`` counts every front-end's requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import mmap
import multiprocessing
import multiprocessing.process
import os
import secrets
import signal
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import orjson

from server.api.errors import APIError, from_exception
from server.api.shm import Regions
from server.api.v2 import require_ready
from server.batching import Result
from server.instance import pin_host
from server.metrics import Metrics, Protocol
from server.repository import ModelRepository, ServedModel
from server.settings import Settings
from server.transport import CoalescedWrites

log = logging.getLogger(__name__)

FRAME = struct.Struct("<II")
"""A frame's prefix: header length, payload length (bytes)."""
SLOTS = 128
"""Shared-memory slots per front-end: as many of its requests as can be in flight without inline copies."""
SLOT_BYTES = 2 * 2**20
"""Bytes per slot, enough for a 224x224 RGB image in fp32 (602 KB) with room to spare; memory is committed only
for the slots a front-end has used."""
TABLE_POLL_S = 0.05
"""How often the engine process looks for model changes (loads, unloads, precision switches) to push."""
HELLO_BYTES = 4096
HELLO_TIMEOUT_S = 5.0
"""How long a new connection has to send its hello before it is dropped."""


def frame(header: dict[str, Any], payload: bytes | memoryview = b"") -> list[bytes | memoryview]:
    """The buffers of one frame, for ``transport.writelines``."""
    head = orjson.dumps(header)
    parts: list[bytes | memoryview] = [FRAME.pack(len(head), len(payload)), head]
    if payload:
        parts.append(payload)
    return parts


class FrameReader:
    """Cuts a byte stream into (header, payload) frames."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[tuple[dict[str, Any], bytearray]]:
        self._buf += data
        out: list[tuple[dict[str, Any], bytearray]] = []
        buf, pos = self._buf, 0
        while len(buf) - pos >= FRAME.size:
            head_len, payload_len = FRAME.unpack_from(buf, pos)
            end = pos + FRAME.size + head_len + payload_len
            if len(buf) < end:
                break
            start = pos + FRAME.size
            header = orjson.loads(memoryview(buf)[start : start + head_len])
            out.append((header, buf[start + head_len : end]))
            pos = end
        if pos:
            del buf[:pos]
        return out


def table(repo: ModelRepository) -> list[dict[str, Any]]:
    """What a front-end needs of each model to decode its requests."""
    return [
        {
            "name": s.name,
            "version": s.version,
            "state": s.state.value,
            "error": s.error,
            "precision": s.precision.value if s.precision is not None else None,
            "manifest": s.manifest.model_dump(mode="json"),
            "batching": s.batching.model_dump(mode="json"),
        }
        for s in repo.models.values()
    ]


def _signature(repo: ModelRepository, regions: Regions) -> tuple[object, ...]:
    models = tuple(
        (s.name, s.version, s.state, s.precision, id(s.manifest), s.batcher is None) for s in repo.models.values()
    )
    return models, regions.generation


@dataclass
class Segment:
    """A front-end's shared memory, cut into slots of ``slot_bytes``; mapped by it and by the engine process."""

    memory: mmap.mmap
    slot_bytes: int

    def view(self, slot: int, dtype: np.dtype[Any], shape: list[int] | tuple[int, ...]) -> np.ndarray:
        """The array of ``dtype`` and ``shape`` at the start of ``slot``."""
        count = math.prod(shape)  # numpy.prod costs ~10 us of Python per call, here twice per request
        return np.frombuffer(self.memory, dtype, count, slot * self.slot_bytes).reshape(shape)


class HelloRefused(Exception):
    """A connection's hello was late, malformed or not from one of this run's front-ends."""


class _Connection(asyncio.Protocol):
    """One front-end's connection, on the engine process's event loop."""

    def __init__(self, backplane: Backplane, segment: Segment, unpin: Callable[[], None] | None = None) -> None:
        self.backplane = backplane
        self.segment = segment
        self.unpin = unpin
        self.reader = FrameReader()
        self.transport: asyncio.Transport | None = None
        self.pending: set[asyncio.Future[Result]] = set()
        """Requests queued or running, answered from a callback when done (no task per request)."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A batch's answers go out in one write. (The cast: uvloop's transports are not asyncio's subclasses either.)
        self.transport = cast(asyncio.Transport, CoalescedWrites(transport))
        self.send({"op": "table", **self.backplane.table()})

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.backplane.connections.discard(self)
        for f in list(self.pending):
            f.cancel()  # rows not yet running are withdrawn
            f.add_done_callback(self._release)
        self._release()

    def _release(self, _: object = None) -> None:
        """Unpin the front-end's memory once it is gone and none of its requests is left running."""
        if self.transport is None and not self.pending and self.unpin is not None:
            self.unpin()
            self.unpin = None

    def send(self, header: dict[str, Any], payload: bytes | memoryview = b"") -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.writelines(frame(header, payload))

    def data_received(self, data: bytes) -> None:
        for header, payload in self.reader.feed(data):
            op = header.get("op")
            if op == "infer":
                self._infer(header, payload)
            elif op == "record":
                self.backplane.record(header["records"])
            elif op == "table":
                self.send({"id": header["id"], **self.backplane.table()})

    def _infer(self, head: dict[str, Any], payload: bytearray) -> None:
        try:
            served = self.backplane.repo.get(head["model"])
            future = served.submit(self._input(served, head, payload), head.get("timeout"))
        except Exception as e:
            self._fail(head["id"], e)
            return
        self.pending.add(future)
        future.add_done_callback(functools.partial(self._answer, head["id"], head["slot"], served))

    def _answer(self, rid: int, slot: int, served: ServedModel, future: asyncio.Future[Result]) -> None:
        self.pending.discard(future)
        if future.cancelled():  # the front-end is gone
            return
        error = future.exception()
        if error is not None:
            self._fail(rid, error)
            return
        result = served.prediction(future.result())
        out = result.outputs
        reply = {"id": rid, "status": 200, "dtype": out.dtype.str, "shape": out.shape, "precision": result.precision}
        if slot >= 0 and out.nbytes <= self.segment.slot_bytes:
            np.copyto(self.segment.view(slot, out.dtype, list(out.shape)), out)
            self.send(reply)
        else:
            self.send({**reply, "slot": -1}, np.ascontiguousarray(out).data.cast("B"))

    def _fail(self, rid: int, e: BaseException) -> None:
        err = from_exception(e if isinstance(e, Exception) else RuntimeError(repr(e)))
        self.send({"id": rid, "status": err.status, "error": err.message, "headers": err.headers})

    def _input(self, served: ServedModel, head: dict[str, Any], payload: bytearray) -> np.ndarray:
        if head["version"] != served.version:
            raise APIError(503, f"model {served.name!r} was reloaded as version {served.version}; retry", {})
        require_ready(served, None)
        dtype, shape = np.dtype(head["dtype"]), head["shape"]
        if shape[1:] != served.manifest.inputs[0].shape:
            raise APIError(503, f"model {served.name!r} changed its input while this request was decoded; retry")
        if head["slot"] >= 0:
            return self.segment.view(head["slot"], dtype, shape)
        return np.frombuffer(payload, dtype).reshape(shape)


class Backplane:
    """The engine process's end: accepts front-ends on a Unix socket and serves their requests from ``repo``."""

    def __init__(
        self, path: str, repo: ModelRepository, metrics: Metrics, expected: int, regions: Regions, secret: str
    ) -> None:
        self.path = path
        self.secret = secret
        """The run's secret (:attr:`Frontends.secret`): a hello without it is dropped."""
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
            memory, unpin = await loop.run_in_executor(None, self._open_segment, hello, fd)
        except (HelloRefused, OSError, ValueError, TypeError, KeyError) as e:
            log.warning("a connection to the backplane was dropped: %s", e)
            conn.close()
            return
        connection = _Connection(self, Segment(memory, hello["slot_bytes"]), unpin)
        self.connections.add(connection)
        await loop.connect_accepted_socket(lambda: connection, sock=conn)
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

    def _open_segment(self, hello: dict[str, Any], fd: int) -> tuple[mmap.mmap, Callable[[], None] | None]:
        """Map a front-end's memfd and, on a CUDA engine, page-lock it, so that batches copy its slots straight to
        the device (about 0.1 ms per image less on the instance's thread)."""
        try:
            memory = mmap.mmap(fd, hello["slots"] * hello["slot_bytes"])
        finally:
            os.close(fd)
        unpin = pin_host(memory) if self.repo.device.type == "cuda" else None
        if self.repo.device.type == "cuda" and unpin is None:
            log.warning("front-end %s: shared memory not page-locked; batches stage it", hello.get("index"))
        return memory, unpin

    def table(self) -> dict[str, Any]:
        """What front-ends mirror: the model table and the shared memory regions."""
        return {"models": table(self.repo), "regions": self.regions.status()}

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
        """Count front-ends' requests: ``[model, precision, protocol, status, rows, seconds]`` each."""
        for model, precision, protocol, status, rows, seconds in records:
            self.metrics.request(model, precision, Protocol(protocol), status, rows, seconds)

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


class Frontends:
    """The front-end processes: spawned with the listening socket, restarted if one dies, stopped on a drain."""

    def __init__(self, settings: Settings, sock: socket.socket, folder: str) -> None:
        self.settings = settings
        self.sock = sock
        self.api_socket = os.path.join(folder, "api.sock")
        self.backplane_socket = os.path.join(folder, "backplane.sock")
        self.secret = secrets.token_hex(32)
        """What a front-end's hello must carry: handed to each one as it is spawned (through multiprocessing's pipe,
        never its command line or environment), so no other process, the same user's included, can attach."""
        self.processes: dict[int, multiprocessing.process.BaseProcess] = {}
        self.stopping = False
        self._context = multiprocessing.get_context("spawn")

    def start(self) -> None:
        for i in range(self.settings.http_workers):
            self._spawn(i)

    def _spawn(self, index: int) -> None:
        from server import frontend

        args = (self.settings, self.sock, self.api_socket, self.backplane_socket, self.secret, index)
        process = self._context.Process(target=frontend.run, args=args, name=f"halfserve-http-{index}", daemon=False)
        process.start()
        self.processes[index] = process

    async def watch(self) -> None:
        """Restart a front-end that exits while the server is not stopping."""
        while not self.stopping:
            await asyncio.sleep(0.5)
            for index, process in list(self.processes.items()):
                if not process.is_alive() and not self.stopping:
                    code = process.exitcode
                    log.error("front-end %d (pid %s) exited with %s; restarting it", index, process.pid, code)
                    self._spawn(index)

    def stop(self) -> None:
        """Tell every front-end to drain: it stops accepting, answers what it holds, and exits."""
        if self.stopping:
            return
        self.stopping = True
        for process in self.processes.values():
            if process.pid is not None and process.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signal.SIGTERM)

    async def join(self, timeout: float) -> None:
        """Wait up to ``timeout`` for the front-ends to exit, then kill what is left."""
        self.stop()
        deadline = time.monotonic() + timeout
        for process in self.processes.values():
            await asyncio.to_thread(process.join, max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                log.error("front-end (pid %s) did not drain in time; killing it", process.pid)
                process.kill()
                await asyncio.to_thread(process.join, 5.0)
        self.sock.close()
