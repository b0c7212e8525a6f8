"""A team's handler called per batch: concurrent requests to one handler model gathered into one ``preprocess``, one
forward and one ``postprocess`` (issue 51), as TorchServe's batching calls its handlers.

A request is one HTTP request's job (its payloads, one or several files); a batch takes whole requests in arrival
order, up to ``max_batch_size`` payloads (a request of more payloads than that runs alone, never split: its payloads
are one call's), and is cut once that many are queued or ``max_delay`` has passed since the first queued request
arrived. The queue holds at most ``max_queue_payloads``; one more is refused at once (:class:`QueueFullError`, a 503
to retry). The payloads' bytes are held to ``max_queue_bytes`` from a request's arrival until its batch has run (or
it left the queue): a request past it is refused at once too, so large payloads waiting for the handler cannot fill
the memory that a count of payloads would let them.

Faults stay with the request that causes them, which TorchServe's batching does not do: a batch of several requests
whose run fails in a way one request could cause (``alone`` of the exception: the handler raised, returned the wrong
inputs or the wrong number of answers, or ran past its time limit on payloads one request made slow) is rerun one
request per call, one at a time, so only the bad request gets its error. Reruns go lightest first (fewest bytes),
so a small request caught in a batch with a heavy one is answered before the heavy one runs again.

A request's deadline is kept while it is queued here (answered :class:`DeadlineExceededError` at once, never run);
once its batch runs, the run is given the longest time left of the batch's requests, which bounds its wait for the
model. A batch the model holds before an instance takes it (``held`` of its requests: an instance process restarting)
is as good as queued: a deadline that passes meanwhile answers its request so, and the batch goes on for the others,
the expired one's answers discarded; once an instance took the batch, its requests are left to finish. A request
whose caller stops waiting (a client gone) is withdrawn if still queued, and its answers discarded if its batch runs:
the batch runs as a task of its own, never in a caller's.

Pure asyncio: no torch, no HTTP, and not the model's batcher; tested with a fake run and a fake clock.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from halfserve.clock import Clock, LoopClock, Timer
from halfserve.errors import DeadlineExceededError, InternalError, QueueFullError, RequestTooLargeError

J = TypeVar("J")
"""A request's job: what the run is given for it."""
R = TypeVar("R")
"""A request's result: what the run returns for it."""

Run = Callable[[list[J], float | None], Awaitable[Sequence[R]]]
"""A batch's run: the jobs in arrival order and the seconds left to the latest deadline (None: no deadline), to one
result per job in the same order, or an exception that fails them all."""


@dataclass(eq=False)
class _Queued(Generic[J, R]):
    job: J
    size: int
    weight: int
    future: asyncio.Future[R]
    enqueued: float
    deadline: float | None
    timer: Timer | None = field(default=None)
    running: bool = False
    """In a batch that has started: its bytes are held until the batch is over, answered or not."""
    released: bool = False


class HandlerBatcher(Generic[J, R]):
    """Gather jobs into batches for ``run``, at most ``concurrency`` running at once; see the module. Create it in a
    running event loop; it needs no start or stop: its timers and batch tasks live on that loop, and a batch in flight
    at shutdown finishes as its callers' requests are drained."""

    def __init__(
        self,
        run: Run[J, R],
        *,
        size: Callable[[J], int],
        alone: Callable[[BaseException], bool],
        max_batch_size: int,
        max_delay: float,
        max_queue_payloads: int,
        concurrency: int,
        weight: Callable[[J], int] = lambda _: 0,
        max_queue_bytes: int | None = None,
        also_held: Callable[[], int] = lambda: 0,
        held: Callable[[J], bool] = lambda _: False,
        clock: Clock | None = None,
    ) -> None:
        if max_batch_size < 1 or max_queue_payloads < 1 or max_delay < 0 or concurrency < 1:
            raise ValueError("max_batch_size, max_queue_payloads and concurrency must be >= 1 and max_delay >= 0")
        self.run = run
        self.size = size
        self.weight = weight
        self.max_queue_bytes = max_queue_bytes
        """Bytes (``weight``) of the requests queued or in a batch running that a request may join (None: no bound)."""
        self.also_held = also_held
        """Bytes held besides, counted against ``max_queue_bytes`` too: a call past its time limit still reads its
        payloads after its batch is over."""
        self.held = held
        """Whether a job of a batch running waits in the model, no instance having taken its batch yet."""
        self.alone = alone
        self.max_batch_size = max_batch_size
        self.max_delay = max_delay
        self.max_queue_payloads = max_queue_payloads
        self.concurrency = concurrency
        self.clock: Clock = clock or LoopClock()
        self.loop = asyncio.get_running_loop()
        self.batch_sizes: list[int] = []
        """Payloads of each batch run, in the order they ran (a rerun alone not counted): what tests and metrics
        read."""
        self._queue: deque[_Queued[J, R]] = deque()
        self._queued_payloads = 0
        self._held_bytes = 0
        self._running = 0
        self._cut_timer: Timer | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def queued_payloads(self) -> int:
        return self._queued_payloads

    @property
    def held_bytes(self) -> int:
        """Bytes of the requests queued or in a batch running, and those :attr:`also_held`."""
        return self._held_bytes + self.also_held()

    def submit(self, job: J, deadline: float | None = None) -> asyncio.Future[R]:
        """Queue ``job``; the future of its result. ``deadline`` is a time on :attr:`clock`. Raises
        :class:`QueueFullError` at once when its payloads do not fit in the queue now, and
        :class:`RequestTooLargeError` when they never would. Cancelling the future withdraws the job if still
        queued."""
        size = self.size(job)
        if size > self.max_queue_payloads:
            raise RequestTooLargeError(
                f"request has {size} payloads; the handler queue holds at most {self.max_queue_payloads}"
            )
        if self._queued_payloads + size > self.max_queue_payloads:
            raise QueueFullError(
                f"handler queue full ({self._queued_payloads} of {self.max_queue_payloads} payloads queued, "
                f"request has {size})"
            )
        weight = self.weight(job)
        most = self.max_queue_bytes
        if most is not None and weight > most:
            raise RequestTooLargeError(
                f"request has {weight} bytes of payloads; the handler queue holds at most {most} (handler_queue_bytes)"
            )
        held = self.held_bytes
        if most is not None and held + weight > most:
            raise QueueFullError(
                f"handler queue full ({held} bytes of payloads queued or running, request has {weight}; "
                f"at most {most}: handler_queue_bytes)"
            )
        now = self.clock.now()
        future: asyncio.Future[R] = self.loop.create_future()
        queued = _Queued(job, size, weight, future, now, deadline)
        self._queue.append(queued)
        self._queued_payloads += size
        self._held_bytes += weight
        if deadline is not None:
            queued.timer = self.clock.call_later(max(0.0, deadline - now), lambda: self._expire(queued))
        future.add_done_callback(lambda _: self._settled(queued))
        self._cut()
        return future

    def _settled(self, queued: _Queued[J, R]) -> None:
        """A future answered, expired or cancelled: a job still queued leaves the queue."""
        if queued.timer is not None:
            queued.timer.cancel()
        with contextlib.suppress(ValueError):
            self._queue.remove(queued)
            self._queued_payloads -= queued.size
        if not queued.running:  # a running batch holds its requests' bytes until it is over
            self._release(queued)

    def _release(self, queued: _Queued[J, R]) -> None:
        if not queued.released:
            queued.released = True
            self._held_bytes -= queued.weight

    def _expire(self, queued: _Queued[J, R]) -> None:
        if queued.future.done():
            return
        if queued in self._queue or (queued.running and self.held(queued.job)):
            queued.future.set_exception(DeadlineExceededError("deadline passed while the request was queued"))

    def _cut(self) -> None:
        """Start every batch due now, while a slot is free; else wake at the first request's delay."""
        if self._cut_timer is not None:
            self._cut_timer.cancel()
            self._cut_timer = None
        while self._queue and self._running < self.concurrency:
            now = self.clock.now()
            due = self._queue[0].enqueued + self.max_delay
            if self._queued_payloads < self.max_batch_size and now < due:
                self._cut_timer = self.clock.call_later(due - now, self._cut)
                return
            batch = [self._queue.popleft()]
            taken = batch[0].size
            while self._queue and taken + self._queue[0].size <= self.max_batch_size:
                batch.append(self._queue.popleft())
                taken += batch[-1].size
            self._queued_payloads -= taken
            for q in batch:
                q.running = True
            self._running += 1
            self.batch_sizes.append(taken)
            # A task of its own: a caller that stops waiting cancels its future, never the batch its companions wait on.
            task = self.loop.create_task(self._execute(batch), name="handler-batch")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _timeout(self, batch: list[_Queued[J, R]]) -> float | None:
        deadlines = [q.deadline for q in batch]
        if any(d is None for d in deadlines):
            return None
        return max(0.0, max(d for d in deadlines if d is not None) - self.clock.now())

    async def _execute(self, batch: list[_Queued[J, R]]) -> None:
        try:
            await self._answer(batch)
        except Exception as e:  # a bug here must still answer every request of the batch, never strand one
            for q in batch:
                _fail(q, InternalError(f"{type(e).__name__}: {e}"))
        finally:
            for q in batch:
                self._release(q)
            self._running -= 1
            self._cut()

    async def _answer(self, batch: list[_Queued[J, R]]) -> BaseException | None:
        """Run ``batch``'s requests still waiting and answer them; the error they were failed with, if any."""
        live = [q for q in batch if not q.future.done()]
        if not live:
            return None
        try:
            results = await self.run([q.job for q in live], self._timeout(live))
            if len(results) != len(live):
                raise InternalError(f"handler batch returned {len(results)} results for {len(live)} requests")
        except Exception as e:
            if len(live) > 1 and self.alone(e):
                # One request may have caused it: each alone, so only its own call fails. Within the batch's own
                # slot, one at a time (a handler may hold a batch's state on itself, and a call past its time limit
                # still holds a handler thread: side by side, a heavy request's call would take the thread a light
                # one's postprocess waits for), the lightest first, so a small request is not kept waiting behind a
                # heavy one's second run.
                ordered = sorted(live, key=lambda q: q.weight)
                for i, q in enumerate(ordered):
                    failed = await self._answer([q])
                    if failed is not None and not self.alone(failed):
                        # Not that request's doing (the handler's threads all held by calls past their limit, the
                        # model gone): each of the rest would wait its turn to hear the same.
                        for rest in ordered[i + 1 :]:
                            _fail(rest, failed)
                        break
                return None
            for q in live:
                _fail(q, e)
            return e
        for q, result in zip(live, results, strict=True):
            if not q.future.done():
                q.future.set_result(result)
        return None


def _fail(queued: _Queued[J, R], e: BaseException) -> None:
    if not queued.future.done():
        queued.future.set_exception(e)
