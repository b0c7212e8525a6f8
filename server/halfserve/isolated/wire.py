"""An instance process's wire end, seen from the server process: :class:`InstanceProcess`, its socket, its shared
memory and its op in flight (a batch, or a handler batch), the frames it sends and the answers it reads back.

It runs on the event loop's thread. What it serves is its owner's (:class:`~halfserve.isolated.engine.ProcessEngine`,
seen here as an :class:`Owner`): which op goes to which process, and what is done once a process is idle again or
lost; starting and restarting it is its supervisor's (:mod:`halfserve.isolated.supervision`).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import multiprocessing.process
import socket
from collections.abc import Callable
from typing import Any, Protocol, cast

import numpy as np

from halfserve.engine.protocol import EngineError, PrecisionOverflowError
from halfserve.errors import (
    BatchFailedError,
    BatchTooLargeError,
    DeadlineExceededError,
    HandlerTimeLimitError,
    InstanceLostError,
    InternalError,
    InvalidInputError,
    ModelUnavailableError,
    OverLimitError,
    QueueFullError,
)
from halfserve.handlerinput import HandlerSection
from halfserve.ipc import exports
from halfserve.ipc.frames import FrameReader, frame
from halfserve.ipc.memory import InstanceMemory
from halfserve.ipc.tensors import descr, dtype_of
from halfserve.isolated import handling
from halfserve.isolated.handling import HandledOutcomes
from halfserve.isolated.protocol import IN_FRAME, INPUT_REGION
from halfserve.isolated.supervision import Watchdog
from halfserve.manifest import Precision
from halfserve.serving import HandlerPayload, Outcome, Output

_ERRORS: dict[str, Callable[[str], Exception]] = {
    "BatchTooLargeError": BatchTooLargeError,
    "PrecisionOverflowError": PrecisionOverflowError,
    # A handler batch's (:mod:`halfserve.isolated.handling`), answered as the data plane's handler threads answer.
    "InvalidInputError": InvalidInputError,
    "OverLimitError": OverLimitError,
    "InternalError": InternalError,
    "DeadlineExceededError": DeadlineExceededError,
    "HandlerTimeLimitError": HandlerTimeLimitError,
    "QueueFullError": QueueFullError,
    "BatchFailedError": BatchFailedError,
    "ModelUnavailableError": ModelUnavailableError,
}


def _error(kind: str, message: str) -> Exception:
    """The exception an instance process reported, as the thread mode would have raised it for the batcher."""
    return _ERRORS.get(kind, EngineError)(message)


class Owner(Protocol):
    """What an instance process's wire end uses of the engine it serves
    (:class:`~halfserve.isolated.engine.ProcessEngine`)."""

    name: str
    batch_timeout: float
    copied_bytes: int
    in_place_bytes: int
    handler: HandlerSection | None

    def idle_again(self, instance: InstanceProcess) -> None: ...

    def lost(self, instance: InstanceProcess, was_ready: bool, unrun: list[asyncio.Future[Any]]) -> None:
        """``instance``'s socket closed; ``unrun`` are the futures of the ops it never took, the owner's to answer or
        send again."""


class InstanceProcess(asyncio.Protocol):
    """One instance process, seen from the server process: its socket end, its shared memory, its batch in flight."""

    def __init__(self, owner: Owner, index: int, memory: InstanceMemory) -> None:
        self.owner, self.index, self.memory = owner, index, memory
        self.process: multiprocessing.process.BaseProcess | None = None
        self._pid: int | None = None
        """The process's pid, kept: a closed ``Process`` no longer tells it."""
        self.transport: asyncio.Transport | None = None
        self.ready: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self.alive = False
        self.forwards = 0
        """Forwards run in the process so far (warm-up included), as :attr:`Instance.forwards` counts them."""
        self.counts: dict[str, int] = {}
        self.side: socket.socket | None = None
        """The blocking side channel that hands the process region descriptors."""
        self.regions: set[int] = set()
        """Regions the process has been handed (and not told to forget)."""
        self._reader = FrameReader()
        self._pending: dict[int, asyncio.Future[Any]] = {}
        """Each op in flight's future: a batch's outcomes, or a handler batch's :data:`HandledOutcomes`."""
        self._next_id = 0
        self.watchdog = Watchdog(owner.name, owner.batch_timeout)
        self.hung = False
        """Whether the watchdog killed the process."""

    def started(self, process: multiprocessing.process.BaseProcess, side: socket.socket) -> None:
        """The process was started, with ``side`` the server process's end of its side channel."""
        self.process, self.side, self._pid = process, side, process.pid

    @property
    def pid(self) -> int | None:
        return self._pid

    @property
    def busy(self) -> bool:
        return bool(self._pending)

    def took(self, op: int) -> bool:
        """Whether the process took op ``op`` (noted its id in shared memory): from then on, it runs it to its end."""
        try:
            return self.memory.taken >= op
        except ValueError:  # unmapped: the process is gone, and an op it had not taken is held for the next one
            return False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports are not asyncio's classes

    def data_received(self, data: bytes) -> None:
        for head, payload in self._reader.feed(data):
            if "id" in head:
                self._answer(head, payload)
            elif head.get("op") == "ready":
                self.alive = True
                if not self.ready.done():
                    self.ready.set_result(head)
            elif head.get("op") == "failed" and not self.ready.done():
                self.ready.set_exception(EngineError(head.get("error", "failed to start")))

    def connection_lost(self, exc: Exception | None) -> None:
        was_alive, self.alive = self.alive, False
        self.watchdog.disarm()
        what = f"instance process {self.index} of model {self.owner.name!r} (pid {self.pid}) exited"
        if self.hung:
            what = (
                f"instance process {self.index} of model {self.owner.name!r} (pid {self.pid}) did not answer a batch "
                f"within {self.owner.batch_timeout:g} s (instance_batch_timeout) and was killed"
            )
        if not self.ready.done():
            self.ready.set_exception(EngineError(what + ("" if was_alive else " before it was ready")))
        # An op sent after the process died (killed from outside, its end not seen yet: the write failed, or went into
        # a socket closing with it) never ran, and no request of it is to blame: its owner sends it again. Only one
        # the process took may have killed it.
        taken = self.memory.taken
        unrun = []
        for op, future in self._pending.items():
            if future.done():
                continue
            if op > taken:
                unrun.append(future)
            else:
                future.set_exception(InstanceLostError(what))
        self._pending.clear()
        with contextlib.suppress(BufferError):  # a view still held: the map goes with the last one
            self.memory.close()
        if self.side is not None:
            self.side.close()
        self.owner.lost(self, was_alive, unrun)

    def send(self, chunks: list[np.ndarray], future: asyncio.Future[list[Outcome]], raw: bool = False) -> int:
        """Tell the process to run a batch; ``future`` gets the outcomes; returns the op's id. Chunks in a
        front-end's shared memory are named where they lie (:mod:`halfserve.ipc.exports`); the others are copied into
        the input region.

        The input region is free: an instance has one batch at a time, and its rows were read before it answered.
        """
        assert self.transport is not None
        first = chunks[0]
        places: list[list[int]] = []
        copies: list[tuple[np.ndarray, int]] = []
        copied = 0
        for c in chunks:
            found = exports.locate(c)
            if found is None:
                places.append([INPUT_REGION, copied, len(c)])
                copies.append((c, copied))
                copied += c.nbytes
                continue
            region, offset = found
            if region.id not in self.regions:
                self._hand(region)
            places.append([region.id, offset, len(c)])
        self.owner.copied_bytes += copied
        self.owner.in_place_bytes += sum(c.nbytes for c in chunks) - copied
        parts: list[memoryview] = []
        if copied > self.memory.input_bytes:  # past the region's estimate (a model's longest rows): in the frame
            places = [[IN_FRAME, *p[1:]] if p[0] == INPUT_REGION else p for p in places]
            parts = [np.ascontiguousarray(c).view(np.uint8).reshape(-1).data for c, _ in copies]
        else:
            for c, offset in copies:
                np.copyto(self.memory.inputs(c.dtype, len(c), c.shape[1:], offset), c)
        head = {"op": "run", "dtype": descr(first.dtype), "shape": first.shape[1:], "chunks": places, "raw": raw}
        return self._send(head, parts, future)

    def _send(
        self, head: dict[str, Any], parts: list[memoryview] | list[bytes], future: asyncio.Future[Any], extra: float = 0
    ) -> int:
        assert self.transport is not None
        self._next_id += 1
        head["id"] = self._next_id
        self._pending[self._next_id] = future
        self.transport.writelines(frame(head, *parts))
        self.watchdog.arm(self, extra)
        return self._next_id

    def handle(self, payloads: list[HandlerPayload], future: asyncio.Future[HandledOutcomes]) -> int:
        """Tell the process to run a handler batch of ``payloads`` (:mod:`halfserve.isolated.handling`); returns the
        op's id."""
        head, parts = handling.handle_frame(payloads)
        section = self.owner.handler
        # Its preprocess and postprocess may each take their time limit (answered 504 then) besides the forward.
        extra = 2 * section.timeout_s if section is not None else 0.0
        return self._send(head, parts, future, extra)

    def _hand(self, region: exports.ExportedRegion) -> None:
        """Send the process a region's descriptor (on the side channel, before the frame that names it)."""
        assert self.side is not None
        exports.hand(self.side, region)
        self.regions.add(region.id)

    def forget(self, region: int) -> None:
        """Tell the process to unmap a region withdrawn (no batch in it is running)."""
        if region in self.regions:
            self.regions.discard(region)
            if self.transport is not None and not self.transport.is_closing():
                self.transport.writelines(frame({"op": "forget", "region": region}))

    def stop(self) -> None:
        """Tell the process to exit once its batch in hand is answered."""
        if self.transport is not None and not self.transport.is_closing():
            self.transport.writelines(frame({"op": "exit"}))

    def _answer(self, head: dict[str, Any], payload: bytearray) -> None:
        self.watchdog.disarm()
        self.counts = head.get("counts", self.counts)
        self.forwards = self.counts.get("forwards", self.forwards)
        future = self._pending.pop(head["id"], None)
        try:
            if future is None or future.done():
                return
            if head.get("raise"):
                future.set_exception(_error(head["kind"], head["message"]))
                return
            # The output region is the next batch's: the bytes the answer used are copied out at once, and each
            # output is a view of that copy (a copy per request cost about 2 us of this loop's time).
            used = self.memory.output(np.dtype(np.uint8), (head.get("region_bytes", 0),), 0)
            assert used is not None
            region = used.copy()
            outcomes = [self._outcome(entry, payload, region) for entry in head["outcomes"]]
            future.set_result(outcomes if "answers" not in head else (handling.answers(head, payload), outcomes))
        finally:
            self.owner.idle_again(self)

    def _outcome(self, entry: list[Any], payload: bytearray, region: np.ndarray) -> Outcome:
        if entry[0] == "error":
            return _error(entry[1], entry[2])
        _, description, shape, offset, tag, inline = entry
        dtype, shape = dtype_of(description), tuple(shape)
        count = math.prod(shape)
        if inline:
            data = np.frombuffer(payload, dtype, count, offset).reshape(shape).copy()
        else:
            data = np.frombuffer(region, dtype, count, offset).reshape(shape)
        return Output(data, Precision(tag) if tag is not None else None)
