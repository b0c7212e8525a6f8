"""Dynamic batching: per model instance, a bounded queue of requests cut into batches of rows.

Pure asyncio and numpy; no torch, no HTTP. A request carries an array whose first dimension is rows (samples).
A batch is cut when ``max_batch_size`` rows are queued or ``max_delay`` has passed since the oldest queued request
arrived (with ``adaptive_delay``, no longer than recent batches took to run, nor once as many rows are queued as
were answered since the last cut: see :class:`Batcher`); only rows of the
same sample shape and dtype are batched together; a request's rows may span batches. The
runner (the contract is :data:`halfserve.serving.Runner`) receives a list of chunks (row slices of requests) and
returns one outcome per chunk: its output rows (an array, or an :class:`~halfserve.serving.Output` with the precision
that computed them), or an exception that fails that chunk's request alone.

Faults stay with the requests that cause them. A batch whose runner raises is bisected: its chunks are rerun as two
smaller batches, recursively, until the failing chunks stand alone, so only their requests fail. A batch that lost its
instance (:class:`~halfserve.errors.InstanceLostError`: a killed instance process) is rerun one chunk per batch
instead,
and a runner with no instance to take the batch (:class:`~halfserve.errors.ModelNotReadyError`) fails its requests with
that error, to be sent again. A runner that raises
:class:`BatchTooLargeError` (the device ran out of memory) makes the batcher halve its batch size for good and rerun
the rows in batches of the new size, splitting requests where needed. The batcher knows chunks and so owns the split;
what counts as "too large" is the runner's call (the engine maps torch's out-of-memory error onto it).

A request's deadline is enforced by a timer: when it passes while any of the request's rows are still queued, the
request is answered with :class:`DeadlineExceededError` at once and its queued rows never run; rows of it already in
a running batch finish with that batch and are discarded. A request whose rows are all running is left to finish.
Rows in a batch the runner holds before an instance takes it (a :class:`~halfserve.serving.HeldAnswer` not yet
started: an instance process restarting) count as queued: the request is answered so, and the batch goes on for its
other requests, the expired one's outputs discarded.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections import deque
from collections.abc import Awaitable, Callable, Hashable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, TypeVar, overload

import numpy as np

from halfserve.batchcut import Chunk, Finish, Pending, Result, cut_batch, seconds_until_cut, split_rows
from halfserve.batchstats import BatchStats
from halfserve.clock import Clock, LoopClock, Timer

if TYPE_CHECKING:
    from halfserve.manifest import Precision

from halfserve.errors import (
    BatchFailedError,
    BatchTooLargeError,
    DeadlineExceededError,
    InstanceLostError,
    ModelNotReadyError,
    QueueFullError,
    RequestTooLargeError,
    ShuttingDownError,
)
from halfserve.serving import HeldAnswer, Outcome, Output, Runner

__all__ = ["BatchObserver", "Batcher"]

T = TypeVar("T")


class BatchObserver(Protocol):
    """Told of each chunk cut into a batch and each batch run; metrics hang here. Called on the event loop, so it
    must be cheap and must not raise."""

    def queued(self, waits: list[float]) -> None:
        """The chunks of a batch just cut waited these seconds in the queue, one figure each. Told once per batch
        rather than per chunk: the observer can record a batch's waits together."""

    def ran(self, rows: int, seconds: float) -> None:
        """A batch of ``rows`` rows ran successfully in ``seconds``."""


BATCH_SECONDS_WEIGHT = 0.25
"""The weight of the latest batch in :attr:`Batcher.batch_seconds` (the rest is the batches before it)."""


class Batcher:
    """Queue requests and run them in batches through ``runner``; up to ``concurrency`` batches in flight.

    Create it inside a running event loop and call :meth:`start`; :meth:`stop` drains what is queued.
    ``max_batch_size`` is the configured limit; :attr:`max_batch_size` can shrink below it when the runner reports
    a batch too large. :attr:`runner` and :attr:`observer` may be replaced while it runs: batches already running
    finish on the old runner, the next batch (or rerun part of a batch) uses the new one.

    With ``adaptive_delay``, a free slot waits for more requests no longer than recent batches took to run
    (:attr:`batch_seconds`), and never longer than ``max_delay``: where a forward is cheap beside the work of taking
    requests, a lone request starts at once instead of waiting out the delay; where forwards take longer than
    ``max_delay``, the delay still gathers batches. The wait also ends once as many rows are queued as were answered
    since the last batch was cut: clients that send their next request when answered (a load generator's connections,
    a pipeline's workers) have then all come back, and with fewer of them than ``max_batch_size`` waiting on would
    only idle the model while the queue stays as it is. Without it (or before a first batch has run) the wait is
    ``max_delay``, as in Triton's dynamic batcher.
    """

    def __init__(
        self,
        runner: Runner,
        *,
        max_batch_size: int,
        max_delay: float,
        max_queue_rows: int,
        concurrency: int = 1,
        clock: Clock | None = None,
        observer: BatchObserver | None = None,
        adaptive_delay: bool = False,
    ) -> None:
        if max_batch_size < 1 or max_queue_rows < 1 or max_delay < 0 or concurrency < 1:
            raise ValueError("max_batch_size, max_queue_rows and concurrency must be >= 1 and max_delay >= 0")
        self.runner = runner
        self.configured_max_batch_size = max_batch_size
        self.max_batch_size = max_batch_size
        self.max_delay = max_delay
        self.max_queue_rows = max_queue_rows
        self.adaptive_delay = adaptive_delay
        self.batch_seconds: float | None = None
        """How long recent batches took to run (a moving average; None before the first)."""
        self.clock: Clock = clock or LoopClock()
        """Injected by tests, whose waits and deadlines then pass without sleeping."""
        self.observer = observer
        self.stats = BatchStats()
        self._queue: deque[Pending] = deque()
        self._queued_rows = 0
        self._wakeup = asyncio.Event()
        self._slots = asyncio.Semaphore(concurrency)
        self._inflight: dict[asyncio.Task[None], _Launched] = {}
        """Each batch task in flight, and the batch it has handed to the runner last (a part rerun, after a failure)."""
        self._closing = False
        self._task: asyncio.Task[None] | None = None
        self._answered_rows = 0
        """Rows answered since the last batch was cut: with ``adaptive_delay``, as many queued again end the wait."""
        self._answered_at = 0.0

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

    async def infer(self, data: np.ndarray, deadline: float | None = None) -> np.ndarray:
        """Queue ``data`` (rows first) and wait for its output rows (:meth:`enqueue`, for callers that want only
        them)."""
        return (await self.enqueue(data, deadline)).data

    @overload
    def enqueue(self, data: np.ndarray, deadline: float | None = None) -> asyncio.Future[Result]: ...

    @overload
    def enqueue(
        self, data: np.ndarray, deadline: float | None, finish: Finish[T], group: Hashable = None
    ) -> asyncio.Future[T]: ...

    def enqueue(
        self, data: np.ndarray, deadline: float | None = None, finish: Finish[Any] = Result, group: Hashable = None
    ) -> Any:
        """Queue ``data`` (rows first); returns the future of its answer: ``finish`` of its output rows and their
        precisions, a :class:`~halfserve.batchcut.Result` by default. Only requests of one ``group`` (and row shape)
        share a batch.

        ``deadline`` is a time on :attr:`clock`. Raises :class:`QueueFullError` at once when the rows do not fit in
        the queue now, :class:`RequestTooLargeError` when they never would; the future fails with
        :class:`DeadlineExceededError` when the deadline passes before all its rows started, and with
        :class:`BatchFailedError` when the runner fails on its rows. Cancelling the future withdraws the rows not
        yet running. A future rather than a coroutine: a caller that answers from a callback (the engine process's
        front-end connections) spares a task per request.
        """
        if self._closing:
            self.stats.failed += 1
            raise ShuttingDownError("server is shutting down")
        rows = int(data.shape[0])
        if rows < 1:
            raise ValueError("a request needs at least one row")
        if rows > self.max_queue_rows:
            self.stats.rejected += 1
            self.stats.failed += 1
            raise RequestTooLargeError(f"request has {rows} rows; the queue holds at most {self.max_queue_rows}")
        if self._queued_rows + rows > self.max_queue_rows:
            self.stats.rejected += 1
            self.stats.failed += 1
            raise QueueFullError(
                f"queue full ({self._queued_rows} of {self.max_queue_rows} rows queued, request has {rows})"
            )
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        was_empty = not self._queue
        start = self.clock.now()
        if was_empty and start - self._answered_at > self.max_delay:
            # Clients answered longer ago than the delay are not coming straight back: a new burst, not a return.
            self._answered_rows = 0
        req = Pending(data, future, start, deadline, finish=finish, group=group)
        self._queue.append(req)
        self._queued_rows += rows
        self.stats.requests += 1
        # Wake the loop only when its wait could change: a first request starts the delay timer, a full batch ends it,
        # and so do its clients all being back (adaptive delay).
        if was_empty or self._queued_rows >= self.max_batch_size or self._clients_back():
            self._wakeup.set()
        timer = None
        if deadline is not None:
            timer = self.clock.call_later(max(0.0, deadline - start), functools.partial(self._expire, req))
        # Registered before any caller awaits the future, so the counts are updated before the caller resumes.
        future.add_done_callback(functools.partial(self._settled, start, timer))
        return future

    def _clients_back(self) -> bool:
        """With ``adaptive_delay``: as many rows are queued as were answered since the last cut. Clients that send
        their next request on their answer have then all come back, and waiting longer would only idle the model."""
        return self.adaptive_delay and 0 < self._answered_rows <= self._queued_rows

    def _settled(self, start: float, timer: Timer | None, future: asyncio.Future[Any]) -> None:
        if timer is not None:
            timer.cancel()
        elapsed = self.clock.now() - start
        if future.cancelled() or future.exception() is not None:
            self.stats.failed += 1
            self.stats.fail_seconds += elapsed
        else:
            self.stats.succeeded += 1
            self.stats.success_seconds += elapsed

    def _expire(self, req: Pending) -> None:
        """The deadline timer: answer ``req`` unless it is answered or all its rows are running."""
        if req.future.done():
            return
        held = self._held_rows(req) if req.taken else 0
        if not req.remaining and not held:
            return
        started = req.taken - held
        with contextlib.suppress(ValueError):
            self._queue.remove(req)
            self._queued_rows -= req.remaining
        req.taken = req.rows
        self.stats.expired += 1
        detail = f" ({started} of its {req.rows} rows had started; their outputs are discarded)" if started else ""
        req.future.set_exception(DeadlineExceededError(f"deadline passed while the request was queued{detail}"))

    def _held_rows(self, req: Pending) -> int:
        """Rows of ``req`` in batches the runner holds that no instance has taken yet (:class:`HeldAnswer`)."""
        held = 0
        for launched in self._inflight.values():
            answer = launched.outcomes
            if isinstance(answer, HeldAnswer) and not answer.done() and not answer.started():
                held += sum(c.rows for c in launched.chunks if c.request is req)
        return held

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._slots.acquire()
            try:
                chunks = await self._next_batch()
            except BaseException:
                self._slots.release()
                raise
            if chunks is None:
                self._slots.release()
                return
            # The batch goes to the runner here, not when its task first runs: an engine's run hands it to the
            # instance's thread at once, while the task's first step would wait behind every callback the event loop
            # has queued (the requests of the batch before, answering).
            launched = self._launch(chunks)
            task = loop.create_task(self._execute(launched))
            self._inflight[task] = launched
            task.add_done_callback(self._inflight.pop)

    async def _next_batch(self) -> list[Chunk] | None:
        while True:
            if not self._queue:
                if self._closing:
                    return None
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            now = self.clock.now()
            delay = 0.0 if self._closing else self.max_delay
            if self.adaptive_delay and self.batch_seconds is not None:
                # Waiting for companions costs every queued request the wait; running now costs one batch's time
                # before the next can start. Waiting no longer than a batch takes keeps a lone request's latency
                # within twice the best, and where batches take longer than max_delay the full delay still applies.
                delay = min(delay, self.batch_seconds)
            wait = seconds_until_cut(self._queued_rows, self._queue[0].enqueued, now, self.max_batch_size, delay)
            if self._clients_back():
                wait = 0.0
            if wait > 0:
                self._wakeup.clear()
                timer = self.clock.call_later(wait, self._wakeup.set)
                try:
                    await self._wakeup.wait()
                finally:
                    timer.cancel()
                continue
            chunks, dropped = cut_batch(self._queue, self.max_batch_size, now)
            self._drop(dropped)
            if chunks:
                self._answered_rows = 0
                self._queued_rows -= sum(c.stop - c.start for c in chunks)
                waits = [now - c.request.enqueued for c in chunks]
                self.stats.queue_seconds += sum(waits)
                self.stats.queued_chunks += len(chunks)
                if self.observer is not None:
                    self.observer.queued(waits)
                return chunks

    def _drop(self, dropped: list[Pending]) -> None:
        for req in dropped:
            self._queued_rows -= req.remaining
            req.taken = req.rows
            if not req.future.done():
                self.stats.expired += 1
                req.future.set_exception(DeadlineExceededError("deadline passed while the request was queued"))

    def _launch(self, chunks: list[Chunk]) -> _Launched:
        """Hand ``chunks`` to the runner, leaving out requests already answered (failed in an earlier part, expired,
        abandoned by the caller)."""
        chunks = [c for c in chunks if not c.request.future.done()]
        start = self.clock.now()
        if not chunks:
            return _Launched(chunks, None, start)
        try:
            outcomes = self.runner([c.data for c in chunks])
        except Exception as e:  # raised before the runner's first await: the batch failed, as if it had run
            failed: asyncio.Future[Sequence[Outcome]] = asyncio.get_running_loop().create_future()
            failed.set_exception(e)
            outcomes = failed
        return _Launched(chunks, outcomes, start)

    async def _execute(self, launched: _Launched) -> None:
        start = launched.start
        freed = False

        def free(ran: bool) -> None:
            """Let the next batch start: once the runner is done with this one, before its requests are answered."""
            nonlocal freed
            if freed:
                return
            freed = True
            if ran:
                took = self.clock.now() - start
                last = self.batch_seconds
                self.batch_seconds = took if last is None else last + BATCH_SECONDS_WEIGHT * (took - last)
            self._slots.release()

        try:
            await self._run(launched.chunks, launched, free)
            free(True)
        except Exception as e:  # a bug here must still answer every request the batch holds, never strand it
            for c in launched.chunks:
                self._fail(c.request, BatchFailedError(f"internal error: {_describe(e)}"))
        finally:
            free(False)

    async def _run(
        self, chunks: list[Chunk], launched: _Launched | None = None, free: Callable[[bool], None] | None = None
    ) -> None:
        """Run one batch (``launched``: already handed to the runner); on failure, rerun its chunks in smaller batches
        until the failure is isolated. ``free`` is called once the runner has answered the whole batch."""
        if launched is None:
            launched = self._launch(chunks)
            task = asyncio.current_task()
            if task is not None and task in self._inflight:  # a part rerun: its rows' deadlines look at it now
                self._inflight[task] = launched
        chunks = launched.chunks
        if launched.outcomes is None:
            return
        rows = sum(c.rows for c in chunks)
        start = launched.start
        try:
            outcomes = await launched.outcomes
            if len(outcomes) != len(chunks):
                n = len(outcomes)
                raise BatchFailedError(f"batch size mismatch: runner returned {n} outputs for {len(chunks)}")
        except BatchTooLargeError as e:
            self.stats.compute_seconds += self.clock.now() - start
            self.stats.failed_batches += 1
            if rows == 1:
                self._fail(chunks[0].request, BatchFailedError(f"{e} (even a single row does not fit)"))
                return
            # A batch cut before an earlier shrink is split at the current size without halving again.
            if rows <= self.max_batch_size:
                self.max_batch_size = max(1, rows // 2)
                self.stats.oom_shrinks += 1
            for part in split_rows(chunks, self.max_batch_size):
                await self._run(part)
            return
        except Exception as e:  # a failing batch fails its own requests, never the loop
            self.stats.compute_seconds += self.clock.now() - start
            self.stats.failed_batches += 1
            if isinstance(e, ModelNotReadyError):  # no instance could take it: no request's fault, sent again later
                for c in chunks:
                    self._fail(c.request, e)
                return
            if len(chunks) == 1:
                err = e if isinstance(e, BatchFailedError) else BatchFailedError(_describe(e))
                self._fail(chunks[0].request, err)
                return
            self.stats.split_retries += 1
            if isinstance(e, InstanceLostError):
                # In halves, the half holding the request that killed the instance would kill each restarted one.
                for c in chunks:
                    await self._run([c])
                return
            half = len(chunks) // 2
            await self._run(chunks[:half])
            await self._run(chunks[half:])
            return
        elapsed = self.clock.now() - start
        self.stats.compute_seconds += elapsed
        self.stats.batches += 1
        self.stats.rows += rows
        self.stats.batch_sizes[rows] += 1
        self.stats.batch_compute_seconds[rows] = self.stats.batch_compute_seconds.get(rows, 0.0) + elapsed
        self.stats.last_inference = time.time()
        if self.observer is not None:
            self.observer.ran(rows, elapsed)
        if free is not None:
            free(True)
        self._answered_rows += rows
        self._answered_at = start + elapsed
        if self._clients_back():
            self._wakeup.set()  # as many already queued again: the adaptive delay's wait is over
        for c, outcome in zip(chunks, outcomes, strict=True):
            if isinstance(outcome, Exception):
                err = outcome if isinstance(outcome, BatchFailedError) else BatchFailedError(_describe(outcome))
                self._fail(c.request, err)
                continue
            out, precision = outcome if isinstance(outcome, Output) else (outcome, None)
            if not isinstance(out, np.ndarray):
                self._fail(c.request, BatchFailedError(f"runner returned {type(out).__name__}, expected an array"))
            elif out.shape[0] != c.rows:
                msg = f"batch size mismatch: runner returned {out.shape[0]} rows for a chunk of {c.rows}"
                self._fail(c.request, BatchFailedError(msg))
            else:
                self._deliver(c, out, precision)

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
    def _deliver(chunk: Chunk, out: np.ndarray, precision: Precision | None) -> None:
        req = chunk.request
        if req.future.done():
            return
        if chunk.start == 0 and chunk.stop == req.rows:
            req.future.set_result(req.finish(out, () if precision is None else (precision,)))
            return
        if req.parts is None:
            req.parts = {}
        req.parts[chunk.start] = (out, precision)
        req.done_rows += chunk.rows
        if req.done_rows == req.rows:
            parts = [req.parts[k] for k in sorted(req.parts)]
            precisions = tuple(dict.fromkeys(p for _, p in parts if p is not None))
            req.future.set_result(req.finish(np.concatenate([o for o, _ in parts]), precisions))


class _Launched(NamedTuple):
    """A batch handed to the runner: its chunks, the outcomes to await (None: no chunk was left to run), and when."""

    chunks: list[Chunk]
    outcomes: Awaitable[Sequence[Outcome]] | None
    start: float


def _describe(e: Exception) -> str:
    return f"{type(e).__name__}: {e}"
