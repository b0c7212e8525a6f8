"""The batcher alone: a fake runner, no torch, no server."""

from __future__ import annotations

import asyncio
import heapq
import time
from collections import deque
from collections.abc import Callable

import numpy as np
import pytest

from halfserve.batchcut import Pending, cut_batch, seconds_until_cut
from halfserve.batching import Batcher
from halfserve.errors import BatchFailedError, DeadlineExceededError, QueueFullError, ShuttingDownError
from tests.waiting import until


class FakeRunner:
    """Doubles its input; records every batch; can be held, or fail batches holding a poisoned value."""

    def __init__(self) -> None:
        self.batches: list[list[np.ndarray]] = []
        self.gate = asyncio.Event()
        self.gate.set()

    async def __call__(self, chunks: list[np.ndarray]) -> list[np.ndarray]:
        self.batches.append(chunks)
        await self.gate.wait()
        if any((c == -1).any() for c in chunks):
            raise ValueError("poisoned input")
        return [c * 2 for c in chunks]

    @property
    def sizes(self) -> list[int]:
        return [sum(len(c) for c in b) for b in self.batches]


class FakeClock:
    """The batcher's clock, moved by the test: waits and deadlines pass without sleeping."""

    def __init__(self) -> None:
        self.time = 1000.0
        self.timers: list[tuple[float, int, Callable[[], object], asyncio.Event]] = []
        self._seq = 0

    def now(self) -> float:
        return self.time

    def call_later(self, delay: float, callback: Callable[[], object]) -> FakeTimer:
        self._seq += 1
        timer = FakeTimer()
        heapq.heappush(self.timers, (self.time + delay, self._seq, callback, timer.cancelled))
        return timer

    async def advance(self, seconds: float) -> None:
        """Move the clock on, firing every timer due by then in order, and let the event loop run what they woke."""
        until = self.time + seconds
        while self.timers and self.timers[0][0] <= until:
            when, _, callback, cancelled = heapq.heappop(self.timers)
            self.time = when
            if not cancelled.is_set():
                callback()
            await settle()
        self.time = until
        await settle()


class FakeTimer:
    def __init__(self) -> None:
        self.cancelled = asyncio.Event()

    def cancel(self) -> None:
        self.cancelled.set()


async def settle() -> None:
    for _ in range(10):
        await asyncio.sleep(0)


def rows(n: int, start: float = 0.0, width: int = 3) -> np.ndarray:
    return np.arange(n * width, dtype=np.float32).reshape(n, width) + start


def pending(data: np.ndarray, enqueued: float = 0.0, deadline: float | None = None) -> Pending:
    fut: asyncio.Future[np.ndarray] = asyncio.get_running_loop().create_future()
    return Pending(data, fut, enqueued, deadline)


# Pure pieces, with a fake clock (async only to own futures) ---------------------------------------------


def test_seconds_until_cut_waits_for_the_oldest_request_delay() -> None:
    assert seconds_until_cut(
        queued_rows=3, oldest=10.0, now=10.001, max_batch_size=8, max_delay=0.005
    ) == pytest.approx(0.004)
    assert seconds_until_cut(queued_rows=3, oldest=10.0, now=10.010, max_batch_size=8, max_delay=0.005) == 0.0
    assert seconds_until_cut(queued_rows=8, oldest=10.0, now=10.0, max_batch_size=8, max_delay=0.005) == 0.0


async def test_cut_batch_takes_oldest_rows_up_to_the_limit_and_splits_a_request() -> None:
    a, b, c = pending(rows(3)), pending(rows(4)), pending(rows(2))
    queue = deque([a, b, c])
    chunks, dropped = cut_batch(queue, max_batch_size=5, now=0.0)
    assert [(ch.request, ch.start, ch.stop) for ch in chunks] == [(a, 0, 3), (b, 0, 2)]
    assert not dropped
    assert list(queue) == [b, c]  # b keeps its place with 2 rows left
    chunks, _ = cut_batch(queue, max_batch_size=5, now=0.0)
    assert [(ch.request, ch.start, ch.stop) for ch in chunks] == [(b, 2, 4), (c, 0, 2)]
    assert np.array_equal(chunks[0].data, rows(4)[2:4])
    assert not queue


async def test_cut_batch_groups_by_sample_shape_and_keeps_order() -> None:
    a, odd, b = pending(rows(1)), pending(rows(1, width=5)), pending(rows(1))
    queue = deque([a, odd, b])
    chunks, _ = cut_batch(queue, max_batch_size=8, now=0.0)
    assert [ch.request for ch in chunks] == [a, b]
    assert list(queue) == [odd]


async def test_cut_batch_drops_requests_past_their_deadline() -> None:
    late, fine = pending(rows(1), deadline=5.0), pending(rows(1), deadline=50.0)
    queue = deque([late, fine])
    chunks, dropped = cut_batch(queue, max_batch_size=8, now=10.0)
    assert dropped == [late]
    assert [ch.request for ch in chunks] == [fine]


# The asyncio loop ------------------------------------------------------------------------------------------------


async def test_cuts_on_size_without_waiting_for_the_delay() -> None:
    runner, clock = FakeRunner(), FakeClock()
    batcher = Batcher(runner, max_batch_size=4, max_delay=30.0, max_queue_rows=64, clock=clock)
    batcher.start()
    futures = [batcher.enqueue(rows(1, i)) for i in range(4)]
    await settle()  # the batcher's clock stands still: only a cut on size runs the batch
    assert runner.sizes == [4]
    assert all(f.done() for f in futures)
    outs = [f.result().data for f in futures]
    for i, out in enumerate(outs):
        assert np.array_equal(out, rows(1, i) * 2)
    await batcher.stop()


async def test_cuts_on_delay_when_the_batch_is_not_full() -> None:
    runner, clock = FakeRunner(), FakeClock()
    batcher = Batcher(runner, max_batch_size=100, max_delay=30.0, max_queue_rows=1000, clock=clock)
    batcher.start()
    futures = [batcher.enqueue(rows(1, i)) for i in range(3)]
    await clock.advance(29.999)  # half a minute on the batcher's clock, none on the wall's
    assert runner.sizes == []
    await clock.advance(0.001)
    assert runner.sizes == [3]
    assert all(f.done() for f in futures)
    assert batcher.stats.batch_sizes == {3: 1}
    assert batcher.stats.queue_seconds == pytest.approx(3 * 30.0)  # measured on the same clock
    await batcher.stop()


async def test_the_delay_counts_from_the_oldest_request() -> None:
    runner, clock = FakeRunner(), FakeClock()
    batcher = Batcher(runner, max_batch_size=100, max_delay=10.0, max_queue_rows=1000, clock=clock)
    batcher.start()
    first = batcher.enqueue(rows(1))
    await clock.advance(6.0)
    second = batcher.enqueue(rows(1, 5))
    await clock.advance(3.9)
    assert runner.sizes == []
    await clock.advance(0.1)  # 10 s after the first, 4 after the second
    assert runner.sizes == [2]
    assert first.done()
    assert second.done()
    await batcher.stop()


def delayed(adaptive: bool) -> tuple[FakeRunner, FakeClock, Batcher]:
    """A started batcher with a 30 s delay on a fake clock, batches of up to 100 rows: what the delay tests share."""
    runner, clock = FakeRunner(), FakeClock()
    batcher = Batcher(
        runner, max_batch_size=100, max_delay=30.0, max_queue_rows=1000, clock=clock, adaptive_delay=adaptive
    )
    batcher.start()
    return runner, clock, batcher


async def batch_taking(
    runner: FakeRunner, clock: FakeClock, batcher: Batcher, wait: float, took: float, requests: int = 1
) -> None:
    """``requests`` one-row requests queued at once: cut after ``wait`` seconds (not a moment before), their batch
    running ``took`` seconds."""
    runner.gate.clear()
    batches = len(runner.batches)
    futures = [batcher.enqueue(rows(1, i)) for i in range(requests)]
    await settle()
    if wait:
        await clock.advance(wait - 1e-6)
        assert len(runner.batches) == batches, "cut before its wait was over"
        await clock.advance(2e-6)
    assert len(runner.batches) == batches + 1, "not cut when its wait was over"
    assert runner.sizes[-1] == requests
    await clock.advance(took)
    runner.gate.set()
    await settle()
    assert all(f.done() for f in futures)


async def test_adaptive_delay_waits_no_longer_than_recent_batches_took() -> None:
    runner, clock, batcher = delayed(adaptive=True)
    # No batch has run yet: the whole delay. Fewer rows come back than the 3 answered: as long as the batch took.
    await batch_taking(runner, clock, batcher, wait=30.0, took=0.5, requests=3)
    assert batcher.batch_seconds == pytest.approx(0.5, abs=1e-5)
    await batch_taking(runner, clock, batcher, wait=0.5, took=0.1, requests=2)
    # A moving average: the latest batch moves it a quarter of the way.
    assert batcher.batch_seconds == pytest.approx(0.5 + 0.25 * (0.1 - 0.5), abs=1e-5)
    await batch_taking(runner, clock, batcher, wait=0.4, took=0.0, requests=1)
    await batcher.stop()


async def test_adaptive_delay_keeps_the_whole_delay_for_batches_slower_than_it() -> None:
    runner, clock, batcher = delayed(adaptive=True)
    await batch_taking(runner, clock, batcher, wait=30.0, took=60.0, requests=3)
    await batch_taking(runner, clock, batcher, wait=30.0, took=60.0, requests=2)
    await batcher.stop()


@pytest.mark.parametrize("adaptive", [True, False])
async def test_a_batch_is_cut_once_as_many_rows_are_back_as_were_answered(adaptive: bool) -> None:
    runner, clock, batcher = delayed(adaptive)
    await batch_taking(runner, clock, batcher, wait=30.0, took=20.0, requests=3)
    # Three clients answered. Two are back: the batch waits (20 s adaptive, as long as the batch took; 30 s fixed).
    back = [batcher.enqueue(rows(1, i)) for i in range(2)]
    await clock.advance(5.0)
    assert runner.sizes == [3]
    # The third: all three are back, so the adaptive delay stops waiting; the fixed delay waits on.
    back.append(batcher.enqueue(rows(1, 2)))
    await settle()
    assert runner.sizes == ([3, 3] if adaptive else [3])
    await clock.advance(25.0)
    assert runner.sizes == [3, 3]
    assert all(f.done() for f in back)
    await batcher.stop()


@pytest.mark.parametrize("adaptive", [True, False])
async def test_a_lone_clients_next_request_starts_at_once_with_the_adaptive_delay(adaptive: bool) -> None:
    runner, clock, batcher = delayed(adaptive)
    await batch_taking(runner, clock, batcher, wait=30.0, took=20.0)
    await batch_taking(runner, clock, batcher, wait=0.0 if adaptive else 30.0, took=20.0)
    await batcher.stop()


async def test_clients_answered_longer_ago_than_the_delay_are_not_waited_for_nor_counted_back() -> None:
    runner, clock, batcher = delayed(adaptive=True)
    await batch_taking(runner, clock, batcher, wait=30.0, took=20.0)
    # The lone client comes back only after more than the delay: a new burst, which waits as long as batches take.
    await clock.advance(31.0)
    await batch_taking(runner, clock, batcher, wait=20.0, took=20.0)
    # Straight back this time: at once.
    await batch_taking(runner, clock, batcher, wait=0.0, took=20.0)
    await batcher.stop()


async def test_rows_answered_while_they_queue_end_the_wait_too() -> None:
    runner, clock, batcher = delayed(adaptive=True)
    await batch_taking(runner, clock, batcher, wait=30.0, took=20.0, requests=2)
    # A batch of 2 runs; 2 rows queue behind it (one request of 2 rows), then it is answered: 2 back, cut at once.
    runner.gate.clear()
    running = [batcher.enqueue(rows(1, i)) for i in range(2)]
    await clock.advance(20.0)
    assert runner.sizes == [2, 2]
    behind = batcher.enqueue(rows(2))
    await clock.advance(1.0)
    assert runner.sizes == [2, 2]  # the batch before is still running
    runner.gate.set()
    await settle()
    assert all(f.done() for f in running)
    assert runner.sizes == [2, 2, 2]
    assert behind.done()
    await batcher.stop()


async def test_without_adaptive_delay_a_lone_request_waits_the_whole_delay_after_fast_batches() -> None:
    runner, clock, batcher = delayed(adaptive=False)
    await batch_taking(runner, clock, batcher, wait=30.0, took=0.5)
    await batch_taking(runner, clock, batcher, wait=30.0, took=0.5)
    await batcher.stop()


async def test_full_queue_rejects_at_once() -> None:
    runner = FakeRunner()
    runner.gate.clear()  # hold the first batch in the runner so the queue fills up behind it
    batcher = Batcher(runner, max_batch_size=2, max_delay=0.0, max_queue_rows=4)
    batcher.start()
    first = asyncio.ensure_future(batcher.infer(rows(2)))
    await until(lambda: runner.batches, "the first batch in the runner")
    queued = [asyncio.ensure_future(batcher.infer(rows(2))) for _ in range(2)]
    await asyncio.sleep(0)
    with pytest.raises(QueueFullError, match="queue full"):
        await batcher.infer(rows(1))
    assert batcher.stats.rejected == 1
    runner.gate.set()
    await asyncio.gather(first, *queued)
    await batcher.stop()


async def test_failing_batch_fails_only_its_own_requests_and_the_loop_keeps_running() -> None:
    runner = FakeRunner()
    batcher = Batcher(runner, max_batch_size=2, max_delay=0.0, max_queue_rows=64)
    batcher.start()
    poisoned = np.full((1, 3), -1, dtype=np.float32)
    results = await asyncio.gather(
        batcher.infer(poisoned), batcher.infer(rows(1)), batcher.infer(rows(1, 5)), return_exceptions=True
    )
    assert isinstance(results[0], BatchFailedError)
    assert "poisoned input" in str(results[0])
    # Shared the poisoned batch, and was answered from the rerun of its half of it.
    assert np.array_equal(results[1], rows(1) * 2)
    assert np.array_equal(results[2], rows(1, 5) * 2)
    assert batcher.stats.failed_batches == 2  # the shared batch, then the poisoned request alone
    assert batcher.stats.split_retries == 1
    # still serving
    assert np.array_equal(await batcher.infer(rows(2)), rows(2) * 2)
    await batcher.stop()


async def test_rows_of_one_request_span_batches_and_come_back_in_order() -> None:
    runner = FakeRunner()
    batcher = Batcher(runner, max_batch_size=4, max_delay=0.0, max_queue_rows=64)
    batcher.start()
    out = await batcher.infer(rows(10))
    assert runner.sizes == [4, 4, 2]
    assert np.array_equal(out, rows(10) * 2)
    await batcher.stop()


async def test_runner_returning_wrong_row_count_fails_the_batch_with_a_clear_error() -> None:
    async def short(chunks: list[np.ndarray]) -> list[np.ndarray]:
        return [c[:-1] for c in chunks]

    batcher = Batcher(short, max_batch_size=4, max_delay=0.0, max_queue_rows=64)
    batcher.start()
    with pytest.raises(BatchFailedError, match="batch size mismatch"):
        await batcher.infer(rows(2))
    await batcher.stop()


async def test_expired_request_is_answered_and_never_run() -> None:
    runner = FakeRunner()
    batcher = Batcher(runner, max_batch_size=4, max_delay=0.0, max_queue_rows=64)
    batcher.start()
    with pytest.raises(DeadlineExceededError):
        await batcher.infer(rows(1), deadline=time.monotonic() - 1)
    assert runner.batches == []
    assert batcher.stats.expired == 1
    await batcher.stop()


async def test_a_deadline_passing_while_queued_answers_at_that_moment() -> None:
    runner, clock = FakeRunner(), FakeClock()
    batcher = Batcher(runner, max_batch_size=100, max_delay=60.0, max_queue_rows=64, clock=clock)
    batcher.start()
    late = batcher.enqueue(rows(1), deadline=clock.now() + 5.0)
    kept = batcher.enqueue(rows(1, 3))
    await clock.advance(4.999)
    assert not late.done()
    await clock.advance(0.001)
    assert isinstance(late.exception(), DeadlineExceededError)
    assert not kept.done()
    await clock.advance(55.0)  # the delay ends: the batch holds the other request only
    assert runner.sizes == [1]
    np.testing.assert_array_equal(kept.result().data, rows(1, 3) * 2)
    await batcher.stop()


async def test_stop_drains_queued_requests_then_refuses_new_ones() -> None:
    runner = FakeRunner()
    batcher = Batcher(runner, max_batch_size=2, max_delay=10.0, max_queue_rows=64)
    batcher.start()
    waiting = [asyncio.ensure_future(batcher.infer(rows(1, i))) for i in range(5)]
    await asyncio.sleep(0)
    await asyncio.wait_for(batcher.stop(), timeout=5)
    assert all(f.done() and not f.exception() for f in waiting)
    with pytest.raises(ShuttingDownError):
        await batcher.infer(rows(1))


class RecordingObserver:
    def __init__(self) -> None:
        self.waits: list[float] = []
        self.batches_cut: list[int] = []
        self.runs: list[tuple[int, float]] = []

    def queued(self, waits: list[float]) -> None:
        self.waits.extend(waits)
        self.batches_cut.append(len(waits))

    def ran(self, rows: int, seconds: float) -> None:
        self.runs.append((rows, seconds))


async def test_observer_hears_every_chunk_queued_and_every_batch_run() -> None:
    runner, observer = FakeRunner(), RecordingObserver()
    b = Batcher(runner, max_batch_size=4, max_delay=0.01, max_queue_rows=64, observer=observer)
    b.start()
    await asyncio.gather(*(b.infer(rows(n)) for n in (3, 2, 1, 5)))
    await b.stop()
    # 11 rows in batches of at most 4: requests of 2 and 5 rows span batches and so are queued chunks twice or more.
    assert [r for r, _ in observer.runs] == runner.sizes
    assert sum(r for r, _ in observer.runs) == 11 == b.stats.rows
    assert len(observer.waits) == b.stats.queued_chunks > 4
    assert len(observer.batches_cut) == len(runner.sizes)  # told once per batch, of all its chunks
    assert sum(observer.waits) == pytest.approx(b.stats.queue_seconds)
    assert sum(s for _, s in observer.runs) == pytest.approx(b.stats.compute_seconds)


async def test_replacing_the_runner_moves_the_next_batch_only() -> None:
    first, second = FakeRunner(), FakeRunner()
    first.gate.clear()
    b = Batcher(first, max_batch_size=2, max_delay=0.0, max_queue_rows=64)
    b.start()
    running = asyncio.ensure_future(b.infer(rows(2)))
    await until(lambda: first.batches, "the first batch in the runner", every=0)
    b.runner = second
    queued = asyncio.ensure_future(b.infer(rows(2, start=100)))
    first.gate.set()
    out = await asyncio.gather(running, queued)
    await b.stop()
    assert first.sizes == [2]
    assert second.sizes == [2]
    np.testing.assert_array_equal(out[0], rows(2) * 2)
    np.testing.assert_array_equal(out[1], rows(2, start=100) * 2)


async def test_enqueue_returns_a_future_whose_cancel_withdraws_its_rows() -> None:
    runner = FakeRunner()
    runner.gate.clear()  # the first batch holds the only slot, so the next requests stay queued
    b = Batcher(runner, max_batch_size=4, max_delay=0.001, max_queue_rows=64)
    b.start()
    first = b.enqueue(rows(4))
    await asyncio.sleep(0.01)
    withdrawn, kept = b.enqueue(rows(2, start=100)), b.enqueue(rows(1, start=200))
    assert b.queued_rows == 3
    withdrawn.cancel()
    runner.gate.set()
    np.testing.assert_array_equal((await kept).data, rows(1, start=200) * 2)
    assert (await first).data.shape == (4, 3)
    assert runner.sizes == [4, 1]  # the cancelled request's rows never ran
    assert b.stats.succeeded == 2
    assert b.stats.failed == 1  # counted by the future's own callback, before the awaiting caller resumed
    await b.stop()


async def test_the_next_batch_reaches_the_runner_before_the_batch_before_is_answered() -> None:
    """A runner that takes a batch when called (as the engine's does, handing it to its thread) gets the next batch
    as soon as it has answered the one before: before that batch's callers resume, behind whom it would otherwise
    wait on a busy event loop."""
    events: list[str] = []
    answers: list[asyncio.Future[list[np.ndarray]]] = []

    def runner(chunks: list[np.ndarray]) -> asyncio.Future[list[np.ndarray]]:
        events.append(f"batch of {sum(len(c) for c in chunks)} taken")
        answers.append(asyncio.get_running_loop().create_future())
        return answers[-1]

    async def caller(i: int) -> None:
        await batcher.enqueue(rows(1, i))
        events.append(f"caller {i} answered")

    batcher = Batcher(runner, max_batch_size=2, max_delay=0.0, max_queue_rows=64)
    batcher.start()
    callers = [asyncio.create_task(caller(i)) for i in range(4)]
    await settle()
    assert events == ["batch of 2 taken"]  # one batch at a time: the second waits for the first
    answers[0].set_result([rows(1, 0) * 2, rows(1, 1) * 2])
    await settle()
    assert events[:2] == ["batch of 2 taken", "batch of 2 taken"]
    assert sorted(events[2:]) == ["caller 0 answered", "caller 1 answered"]
    answers[1].set_result([rows(1, 2) * 2, rows(1, 3) * 2])
    await asyncio.gather(*callers)
    await batcher.stop()
