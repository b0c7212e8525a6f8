"""Dynamic batching: per model instance, a bounded queue of requests cut into batches of rows.

Pure asyncio and numpy; no torch, no HTTP. A request carries an array whose first dimension is rows (samples).
A batch is cut when ``max_batch_size`` rows are queued or ``max_delay`` has passed since the oldest queued request
arrived; only rows of the same sample shape and dtype are batched together; a request's rows may span batches. The
runner receives a list of chunks (row slices of requests) and must return one output per chunk with as many rows.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass, field

import numpy as np

Runner = Callable[[list[np.ndarray]], Awaitable[list[np.ndarray]]]
Clock = Callable[[], float]


class BatchingError(Exception):
    """Base class of the errors a submitted request can fail with."""


class QueueFullError(BatchingError):
    """The queue holds ``max_queue_rows`` rows; the request was not accepted."""


class DeadlineExceededError(BatchingError):
    """The request's deadline passed while it was queued; it was never run."""


class ShuttingDownError(BatchingError):
    """The batcher is draining and accepts no new requests."""


class BatchFailedError(BatchingError):
    """The batch holding this request failed in the runner."""


@dataclass(eq=False)
class Pending:
    """A queued request: its rows, how many have been cut into batches so far, and its outputs as they arrive."""

    data: np.ndarray
    future: asyncio.Future[np.ndarray]
    enqueued: float
    deadline: float | None = None
    taken: int = 0
    done_rows: int = 0
    parts: dict[int, np.ndarray] = field(default_factory=dict)

    @property
    def rows(self) -> int:
        return int(self.data.shape[0])

    @property
    def key(self) -> Hashable:
        return (self.data.shape[1:], self.data.dtype.str)

    @property
    def remaining(self) -> int:
        return self.rows - self.taken


@dataclass(frozen=True)
class Chunk:
    """Rows ``[start, stop)`` of a pending request, as placed into one batch."""

    request: Pending
    start: int
    stop: int

    @property
    def data(self) -> np.ndarray:
        if self.start == 0 and self.stop == self.request.rows:
            return self.request.data
        return self.request.data[self.start : self.stop]


def seconds_until_cut(queued_rows: int, oldest: float, now: float, max_batch_size: int, max_delay: float) -> float:
    """How long to wait before cutting a batch: 0 when full or when the oldest request has waited ``max_delay``."""
    if queued_rows >= max_batch_size:
        return 0.0
    return max(0.0, oldest + max_delay - now)


def cut_batch(queue: deque[Pending], max_batch_size: int, now: float) -> tuple[list[Chunk], list[Pending]]:
    """Take up to ``max_batch_size`` rows from ``queue``, oldest first, of the head request's sample shape.

    Returns the batch's chunks and the requests removed because their deadline passed or their caller went away.
    Requests of another shape keep their place. Fully taken requests leave the queue; a partly taken one stays at
    its place with ``taken`` advanced.
    """
    chunks: list[Chunk] = []
    dropped: list[Pending] = []
    key: Hashable = None
    room = max_batch_size
    kept: deque[Pending] = deque()
    while queue and room:
        req = queue.popleft()
        if req.future.done() or (req.deadline is not None and now >= req.deadline and req.taken == 0):
            dropped.append(req)
            continue
        if key is None:
            key = req.key
        elif req.key != key:
            kept.append(req)
            continue
        n = min(room, req.remaining)
        chunks.append(Chunk(req, req.taken, req.taken + n))
        req.taken += n
        room -= n
        if req.remaining:
            kept.append(req)
    kept.extend(queue)
    queue.clear()
    queue.extend(kept)
    return chunks, dropped


@dataclass
class BatchStats:
    """What a batcher has done: counts, a histogram of batch sizes and summed queue / compute time."""

    requests: int = 0
    rows: int = 0
    batches: int = 0
    failed_batches: int = 0
    rejected: int = 0
    expired: int = 0
    batch_sizes: Counter[int] = field(default_factory=Counter)
    queue_seconds: float = 0.0
    compute_seconds: float = 0.0
    queued_chunks: int = 0
    """How many chunks ``queue_seconds`` sums over (a request spanning batches waits once per chunk)."""
    succeeded: int = 0
    """Requests answered with their outputs."""
    failed: int = 0
    """Requests answered with an error: rejected, expired, failed batch, shutting down or abandoned by the caller."""
    success_seconds: float = 0.0
    """Summed time from submit to answer of the succeeded requests; ``fail_seconds`` likewise for the failed."""
    fail_seconds: float = 0.0
    batch_compute_seconds: dict[int, float] = field(default_factory=dict)
    """Summed runner time of the successful batches, per batch size (the keys of ``batch_sizes``)."""
    last_inference: float = 0.0
    """Wall-clock time (``time.time()``) the last successful batch finished; 0 before the first."""

    def snapshot(self) -> dict[str, object]:
        return {
            "requests": self.requests,
            "rows": self.rows,
            "batches": self.batches,
            "failed_batches": self.failed_batches,
            "rejected": self.rejected,
            "expired": self.expired,
            "mean_batch_size": self.rows / self.batches if self.batches else 0.0,
            "batch_size_histogram": {str(k): v for k, v in sorted(self.batch_sizes.items())},
            "queue_seconds": self.queue_seconds,
            "compute_seconds": self.compute_seconds,
        }


class Batcher:
    """Queue requests and run them in batches through ``runner``; up to ``concurrency`` batches in flight.

    Create it inside a running event loop and call :meth:`start`; :meth:`stop` drains what is queued.
    """

    def __init__(
        self,
        runner: Runner,
        *,
        max_batch_size: int,
        max_delay: float,
        max_queue_rows: int,
        concurrency: int = 1,
        clock: Clock = time.monotonic,
    ) -> None:
        if max_batch_size < 1 or max_queue_rows < 1 or max_delay < 0 or concurrency < 1:
            raise ValueError("max_batch_size, max_queue_rows and concurrency must be >= 1 and max_delay >= 0")
        self.runner = runner
        self.max_batch_size = max_batch_size
        self.max_delay = max_delay
        self.max_queue_rows = max_queue_rows
        self.clock = clock
        self.stats = BatchStats()
        self._queue: deque[Pending] = deque()
        self._queued_rows = 0
        self._wakeup = asyncio.Event()
        self._slots = asyncio.Semaphore(concurrency)
        self._inflight: set[asyncio.Task[None]] = set()
        self._closing = False
        self._task: asyncio.Task[None] | None = None

    @property
    def queued_rows(self) -> int:
        """Rows accepted but not yet cut into a batch."""
        return self._queued_rows

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="batcher")

    async def stop(self) -> None:
        """Stop accepting, run everything already queued, wait for batches in flight, then end the loop."""
        self._closing = True
        self._wakeup.set()
        if self._task is not None:
            await self._task
        if self._inflight:
            await asyncio.gather(*self._inflight, return_exceptions=True)

    async def submit(self, data: np.ndarray, deadline: float | None = None) -> np.ndarray:
        """Queue ``data`` (rows first) and wait for its output rows.

        Raises :class:`QueueFullError` at once when the rows do not fit in the queue.
        """
        if self._closing:
            self.stats.failed += 1
            raise ShuttingDownError("server is shutting down")
        rows = int(data.shape[0])
        if rows < 1:
            raise ValueError("a request needs at least one row")
        if self._queued_rows + rows > self.max_queue_rows:
            self.stats.rejected += 1
            self.stats.failed += 1
            raise QueueFullError(
                f"queue full ({self._queued_rows} of {self.max_queue_rows} rows queued, request has {rows})"
            )
        future: asyncio.Future[np.ndarray] = asyncio.get_running_loop().create_future()
        was_empty = not self._queue
        start = self.clock()
        self._queue.append(Pending(data, future, start, deadline))
        self._queued_rows += rows
        self.stats.requests += 1
        # Wake the loop only when its wait could change: a first request starts the delay timer, a full batch ends it.
        if was_empty or self._queued_rows >= self.max_batch_size:
            self._wakeup.set()
        try:
            out = await future
        except BaseException:
            self.stats.failed += 1
            self.stats.fail_seconds += self.clock() - start
            raise
        self.stats.succeeded += 1
        self.stats.success_seconds += self.clock() - start
        return out

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._slots.acquire()
            try:
                chunks = await self._next_batch(loop)
            except BaseException:
                self._slots.release()
                raise
            if chunks is None:
                self._slots.release()
                return
            task = loop.create_task(self._execute(chunks))
            self._inflight.add(task)
            task.add_done_callback(self._inflight.discard)

    async def _next_batch(self, loop: asyncio.AbstractEventLoop) -> list[Chunk] | None:
        while True:
            if not self._queue:
                if self._closing:
                    return None
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            now = self.clock()
            delay = 0.0 if self._closing else self.max_delay
            wait = seconds_until_cut(self._queued_rows, self._queue[0].enqueued, now, self.max_batch_size, delay)
            if wait > 0:
                self._wakeup.clear()
                timer = loop.call_later(wait, self._wakeup.set)
                try:
                    await self._wakeup.wait()
                finally:
                    timer.cancel()
                continue
            chunks, dropped = cut_batch(self._queue, self.max_batch_size, now)
            self._drop(dropped)
            if chunks:
                self._queued_rows -= sum(c.stop - c.start for c in chunks)
                self.stats.queue_seconds += sum(now - c.request.enqueued for c in chunks)
                self.stats.queued_chunks += len(chunks)
                return chunks

    def _drop(self, dropped: list[Pending]) -> None:
        for req in dropped:
            self._queued_rows -= req.remaining
            if not req.future.done():
                self.stats.expired += 1
                req.future.set_exception(DeadlineExceededError("deadline passed while the request was queued"))

    async def _execute(self, chunks: list[Chunk]) -> None:
        rows = sum(c.stop - c.start for c in chunks)
        start = self.clock()
        try:
            outputs = await self.runner([c.data for c in chunks])
            if len(outputs) != len(chunks):
                raise BatchFailedError(f"batch size mismatch: runner returned {len(outputs)} outputs for {len(chunks)}")
            for c, out in zip(chunks, outputs, strict=True):
                if out.shape[0] != c.stop - c.start:
                    raise BatchFailedError(
                        f"batch size mismatch: runner returned {out.shape[0]} rows for a chunk of {c.stop - c.start}"
                    )
        except Exception as e:  # a failing batch fails its own requests, never the loop
            self.stats.failed_batches += 1
            err = e if isinstance(e, BatchFailedError) else BatchFailedError(f"{type(e).__name__}: {e}")
            for c in chunks:
                self._fail(c.request, err)
            return
        finally:
            elapsed = self.clock() - start
            self.stats.compute_seconds += elapsed
            self._slots.release()
        self.stats.batches += 1
        self.stats.rows += rows
        self.stats.batch_sizes[rows] += 1
        self.stats.batch_compute_seconds[rows] = self.stats.batch_compute_seconds.get(rows, 0.0) + elapsed
        self.stats.last_inference = time.time()
        for c, out in zip(chunks, outputs, strict=True):
            self._deliver(c, out)

    def _fail(self, req: Pending, err: BaseException) -> None:
        if not req.future.done():
            req.future.set_exception(err)
        if req.remaining:
            # Rows of a failed request still queued: take them out so they are not run.
            with contextlib.suppress(ValueError):
                self._queue.remove(req)
                self._queued_rows -= req.remaining
                req.taken = req.rows

    @staticmethod
    def _deliver(chunk: Chunk, out: np.ndarray) -> None:
        req = chunk.request
        if req.future.done():
            return
        if chunk.start == 0 and chunk.stop == req.rows:
            req.future.set_result(out)
            return
        req.parts[chunk.start] = out
        req.done_rows += chunk.stop - chunk.start
        if req.done_rows == req.rows:
            req.future.set_result(np.concatenate([req.parts[k] for k in sorted(req.parts)]))
