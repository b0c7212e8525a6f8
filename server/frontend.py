"""An HTTP front-end process (``--http-workers N``): the inference routes answered here, the rest relayed.

The front-end runs the same inference endpoints as a single-process server (the same decoding, validation, errors and
encoding), but a model's :meth:`RemoteModel.infer` hands the decoded input to the engine process over the backplane
(:mod:`server.backplane`) instead of to a local batcher. Every other request (health, readiness, listings, model
metadata, statistics, metrics, management, the status page) is relayed unchanged to the engine process's own HTTP
server on a Unix socket, so there is one source of truth for the models' state.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import mmap
import os
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, cast

import httpx
import numpy as np
import orjson
from starlette.datastructures import State
from starlette.types import Receive, Scope, Send

from server import api, backplane, logs
from server.api.errors import APIError, error_response
from server.api.limits import scope_header
from server.api.shm import Regions
from server.api.v2_repository import MANAGEMENT_BODY_BYTES, MANAGEMENT_LIMIT, RELAYED_CLIENT
from server.metrics import Protocol
from server.precision import Precision
from server.repository import ModelNotReadyError, ModelState, Prediction, ServedModel, find
from server.settings import Settings
from server.store import Batching, Manifest
from server.transport import CoalescedWrites

log = logging.getLogger(__name__)

RECORD_FLUSH_S = 0.1
"""How often a front-end sends its request counts to the engine process (and so how stale ``/metrics`` may be)."""
HOP_BY_HOP = {b"connection", b"keep-alive", b"transfer-encoding", b"content-length", b"upgrade", b"te", b"trailer"}
"""Headers that describe one connection, not the message: the relay sets its own."""


@dataclass
class _Pending:
    future: asyncio.Future[tuple[dict[str, Any], bytearray]]
    slot: int


class BackplaneClient(asyncio.Protocol):
    """A front-end's connection to the engine process, with its shared-memory slots."""

    def __init__(self, on_table: Any, on_regions: Any) -> None:
        self.on_table = on_table
        self.on_regions = on_regions
        self.reader = backplane.FrameReader()
        self.transport: asyncio.Transport | None = None
        self.pending: dict[int, _Pending] = {}
        self.ids = itertools.count(1)
        self.records: list[list[Any]] = []
        size = backplane.SLOTS * backplane.SLOT_BYTES
        fd = os.memfd_create("halfserve-frontend")
        os.ftruncate(fd, size)
        self.segment = backplane.Segment(mmap.mmap(fd, size), backplane.SLOT_BYTES)
        self._fd = fd
        self.free = list(range(backplane.SLOTS - 1, -1, -1))
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
        hello |= {"slots": backplane.SLOTS, "slot_bytes": self.segment.slot_bytes}
        socket.send_fds(sock, [orjson.dumps(hello)], [self._fd])
        os.close(self._fd)
        sock.setblocking(False)
        await loop.connect_accepted_socket(lambda: self, sock=sock)
        await asyncio.wait_for(self.table_seen.wait(), timeout)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # Requests sent in one iteration go out in one write. (The cast: uvloop's transports are not asyncio's either.)
        self.transport = cast(asyncio.Transport, CoalescedWrites(transport))

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        for p in self.pending.values():
            if not p.future.done():
                p.future.set_exception(ModelNotReadyError("the engine process is gone"))
        self.pending.clear()

    def data_received(self, data: bytes) -> None:
        for header, payload in self.reader.feed(data):
            rid = header.get("id")
            if "models" in header:  # a pushed table, or the answer to a refresh
                self.on_table(header["models"])
                self.on_regions(header["regions"])
                self.table_seen.set()
            if rid is None:
                continue
            pending = self.pending.pop(rid, None)
            if pending is None:
                continue
            if pending.future.done():  # its caller gave up; the slot is free once the answer is in
                self._release(pending.slot)
            else:
                pending.future.set_result((header, payload))

    def _send(self, header: dict[str, Any], payload: bytes | memoryview = b"") -> None:
        if self.transport is None or self.transport.is_closing():
            raise ModelNotReadyError("the engine process is not connected")
        self.transport.writelines(backplane.frame(header, payload))

    def _release(self, slot: int) -> None:
        if slot >= 0:
            self.free.append(slot)

    async def _ask(self, header: dict[str, Any], payload: bytes | memoryview = b"", slot: int = -1) -> Any:
        rid = next(self.ids)
        future: asyncio.Future[tuple[dict[str, Any], bytearray]] = asyncio.get_running_loop().create_future()
        self.pending[rid] = _Pending(future, slot)
        try:
            self._send({**header, "id": rid}, payload)
        except ModelNotReadyError:
            del self.pending[rid]
            self._release(slot)
            raise
        try:
            return await future
        except asyncio.CancelledError:
            future.cancel()  # the slot stays taken until the engine process answers (it may still write into it)
            raise

    async def infer(self, model: RemoteModel, x: np.ndarray, timeout: float | None) -> Prediction:
        slot = self.free.pop() if self.free and x.nbytes <= self.segment.slot_bytes else -1
        head = {"op": "infer", "model": model.name, "version": model.version, "timeout": timeout}
        head |= {"dtype": x.dtype.str, "shape": x.shape, "slot": slot}
        if slot >= 0:
            np.copyto(self.segment.view(slot, x.dtype, x.shape), x)
            header, payload = await self._ask(head, slot=slot)
        else:
            header, payload = await self._ask(head, np.ascontiguousarray(x).data.cast("B"))
        try:
            if header["status"] != 200:
                raise APIError(header["status"], header["error"], header.get("headers"))
            dtype, shape = np.dtype(header["dtype"]), header["shape"]
            if header.get("slot", slot) >= 0:
                out = self.segment.view(slot, dtype, shape).copy()
            else:
                out = np.frombuffer(payload, dtype).reshape(shape)
            return Prediction(out, header["precision"])
        finally:
            self._release(slot)

    async def refresh(self) -> None:
        """Fetch the model table now (after a management call this front-end relayed); the answer updates it."""
        await self._ask({"op": "table"})

    def record(self, row: list[Any]) -> None:
        self.records.append(row)

    def flush(self) -> None:
        if self.records and self.transport is not None:
            records, self.records = self.records, []
            with contextlib.suppress(ModelNotReadyError):
                self._send({"op": "record", "records": records})


@dataclass
class RemoteModel(ServedModel):
    """A model as a front-end knows it: enough to decode its requests; inference runs in the engine process."""

    client: BackplaneClient | None = field(default=None, repr=False)

    @property
    def serving(self) -> bool:
        # The engine process decides readiness (its answer is never stale); a table pushed a moment ago may be.
        return True

    async def infer(self, x: np.ndarray, timeout: float | None = None) -> Prediction:
        assert self.client is not None
        return await self.client.infer(self, x, timeout)


class RemoteRepository:
    """The model table of a front-end, as the engine process last pushed it."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.models: dict[str, RemoteModel] = {}
        self.client: BackplaneClient | None = None

    def update(self, models: list[dict[str, Any]]) -> None:
        fresh: dict[str, RemoteModel] = {}
        for m in models:
            old = self.models.get(m["name"])
            if old is not None and old.version == m["version"] and old.precision == _precision(m["precision"]):
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
                client=self.client,
            )
        self.models = fresh

    def get(self, name: str | None) -> RemoteModel:
        return find(self.models, name)


def _precision(value: str | None) -> Precision | None:
    return Precision(value) if value is not None else None


class RemoteMetrics:
    """Stands in for :class:`server.metrics.Metrics` in a front-end: requests are counted by the engine process."""

    def __init__(self, client: BackplaneClient) -> None:
        self.client = client

    def request(self, model: str, precision: str, protocol: Protocol, status: int, rows: int, seconds: float) -> None:
        self.client.record([model, precision, protocol.value, status, rows, seconds])


class FrontendApp:
    """The front-end's ASGI app: inference routes here, everything else relayed to the engine process."""

    def __init__(self, settings: Settings, api_socket: str, backplane_socket: str, secret: str, index: int) -> None:
        self.settings = settings
        self.api_socket = api_socket
        self.backplane_socket = backplane_socket
        self.secret = secret
        self.index = index
        self.state = State()
        self.state.settings = settings
        self.state.draining = False
        self.repository = RemoteRepository(settings)
        self.state.repository = self.repository
        self.shm = Regions()
        """The engine process's shared memory regions, mapped here too: this process decodes and encodes."""
        self.state.shm = self.shm
        self.http: httpx.AsyncClient | None = None
        self.client: BackplaneClient | None = None
        self._flusher: asyncio.Task[None] | None = None

    def begin_drain(self) -> None:
        self.state.draining = True

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        if not await api.answer_first(self, scope, receive, send):
            await self._relay(scope, receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self._start()
                except Exception as e:
                    log.exception("front-end %d could not start", self.index)
                    await send({"type": "lifespan.startup.failed", "message": str(e)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self._stop()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _start(self) -> None:
        self.client = BackplaneClient(self.repository.update, self.shm.sync)
        self.repository.client = self.client
        self.state.metrics = RemoteMetrics(self.client)
        await self.client.connect(self.backplane_socket, self.index, self.secret)
        self.http = httpx.AsyncClient(
            transport=httpx.AsyncHTTPTransport(uds=self.api_socket), base_url="http://halfserve", timeout=None
        )
        self._flusher = asyncio.create_task(self._flush_records(), name="flush-records")

    async def _flush_records(self) -> None:
        assert self.client is not None
        while True:
            await asyncio.sleep(RECORD_FLUSH_S)
            self.client.flush()

    async def _stop(self) -> None:
        if self._flusher is not None:
            self._flusher.cancel()
        if self.client is not None:
            self.client.flush()
            if self.client.transport is not None:
                self.client.transport.close()
        if self.http is not None:
            await self.http.aclose()

    async def _relay(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Forward a request to the engine process's HTTP server and stream its answer back.

        Every relayed route is a small one (a listing, a management call): a body over
        :data:`~server.api.v2_repository.MANAGEMENT_BODY_BYTES` is a 413, before any of it is read when its length is
        declared. The body is streamed to the engine process, never gathered here, and the engine process checks the
        admin token before it reads a byte of it; it learns the client's address from :data:`RELAYED_CLIENT`, so a
        wrong token counts against that address, not against every client of the front-ends.
        """
        assert self.http is not None
        assert self.client is not None
        declared = scope_header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > RELAY_BODY_BYTES:
            message = f"body: {declared.decode()} bytes exceed {MANAGEMENT_LIMIT}"
            await error_response(413, message)(scope, receive, send)
            return
        target = scope.get("raw_path") or scope["path"].encode()
        if scope.get("query_string"):
            target += b"?" + scope["query_string"]
        headers = [(k, v) for k, v in scope["headers"] if k not in HOP_BY_HOP and k != RELAYED_CLIENT]
        if declared is not None:
            headers.append((b"content-length", declared))  # the body goes on as sent, not re-chunked
        client = scope.get("client")
        if client:
            headers.append((RELAYED_CLIENT, str(client[0]).encode("latin-1")))
        has_body = declared is not None or scope_header(scope, b"transfer-encoding") is not None
        url = target.decode("latin-1")
        content = _body(receive) if has_body else None
        request = self.http.build_request(scope["method"], url, headers=headers, content=content)
        try:
            response = await self.http.send(request, stream=True)
        except _ClientGone:
            return  # nobody to answer
        except _TooLarge:
            message = f"body: more than {RELAY_BODY_BYTES} bytes ({MANAGEMENT_LIMIT})"
            await error_response(413, message)(scope, receive, send)
            return
        except httpx.TransportError as e:
            message = f"the engine process is not answering ({type(e).__name__})"
            await error_response(503, message)(scope, receive, send)
            return
        try:
            out_headers = [(k, v) for k, v in response.headers.raw if k.lower() not in HOP_BY_HOP]
            await send({"type": "http.response.start", "status": response.status_code, "headers": out_headers})
            async for chunk in response.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
        finally:
            await response.aclose()
        if scope["method"] not in ("GET", "HEAD") and response.status_code < 400:
            # A management call may have changed a model: know it before the client's next request arrives here.
            with contextlib.suppress(Exception):
                await self.client.refresh()


RELAY_BODY_BYTES = MANAGEMENT_BODY_BYTES
"""Largest body a front-end relays: every route it relays is a listing or a management call."""


class _ClientGone(Exception):
    """The client went away before its body was whole."""


class _TooLarge(Exception):
    """The body grew past :data:`RELAY_BODY_BYTES`."""


async def _body(receive: Receive) -> AsyncIterator[bytes]:
    """A request's body as it arrives, for the relay's upstream request: counted, never gathered."""
    received = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _ClientGone
        chunk = message.get("body", b"")
        received += len(chunk)
        if received > RELAY_BODY_BYTES:
            raise _TooLarge
        if chunk:
            yield chunk
        if not message.get("more_body"):
            return


def run(
    settings: Settings, sock: socket.socket, api_socket: str, backplane_socket: str, secret: str, index: int
) -> None:
    """A front-end process's main: serve ``sock`` (the listening socket every front-end shares) until told to stop."""
    from server.app import DrainingServer, uvicorn_config

    log_config = logs.configure(settings.log_format, settings.log_level, settings.access_log)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per relayed request otherwise
    app = FrontendApp(settings, api_socket, backplane_socket, secret, index)
    DrainingServer(uvicorn_config(app, settings, log_config), app.begin_drain).run(sockets=[sock])
