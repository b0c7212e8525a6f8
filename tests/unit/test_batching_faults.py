"""The batcher under faults: failures isolated by bisection, out-of-memory batches split, deadlines, precisions.

Fake runners only: one that raises for a poisoned row, one that raises an out-of-memory-like error above N rows.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from halfserve.batchcut import Chunk, Pending, split_rows
from halfserve.batching import Batcher
from halfserve.errors import (
    BatchFailedError,
    BatchTooLargeError,
    DeadlineExceededError,
    InstanceLostError,
    ModelNotReadyError,
    RequestTooLargeError,
)
from halfserve.serving import HeldAnswer, Outcome, Output
from tests.waiting import until

POISON = -1.0


def rows(n: int, start: float = 0.0, width: int = 3) -> np.ndarray:
    return np.arange(n * width, dtype=np.float32).reshape(n, width) + start


def poisoned(n: int = 1) -> np.ndarray:
    return np.full((n, 3), POISON, dtype=np.float32)


class Runner:
    """Doubles its input and records each batch's row count. Raises for a batch holding a poisoned row, raises
    :class:`BatchTooLargeError` for more than ``oom_above`` rows, and can be held at a gate."""

    def __init__(self, oom_above: int | None = None) -> None:
        self.oom_above = oom_above
        self.sizes: list[int] = []
        self.gate = asyncio.Event()
        self.gate.set()
        self.entered = asyncio.Event()

    async def __call__(self, chunks: list[np.ndarray]) -> list[Outcome]:
        n = sum(len(c) for c in chunks)
        self.sizes.append(n)
        self.entered.set()
        await self.gate.wait()
        if self.oom_above is not None and n > self.oom_above:
            raise BatchTooLargeError(f"out of memory running {n} rows")
        if any((c == POISON).any() for c in chunks):
            raise ValueError("poisoned row")
        return [c * 2 for c in chunks]


async def started(batcher: Batcher) -> Batcher:
    batcher.start()
    return batcher


# Splitting rows, the pure part -----------------------------------------------------------------------------------


async def test_split_rows_regroups_chunks_into_batches_of_at_most_size_rows() -> None:
    loop = asyncio.get_running_loop()
    a = Pending(rows(5), loop.create_future(), 0.0)
    b = Pending(rows(2), loop.create_future(), 0.0)
    chunks = [Chunk(a, 0, 5), Chunk(b, 0, 2)]
    batches = split_rows(chunks, 3)
    assert [[(c.request, c.start, c.stop) for c in batch] for batch in batches] == [
        [(a, 0, 3)],
        [(a, 3, 5), (b, 0, 1)],
        [(b, 1, 2)],
    ]
    assert split_rows(chunks, 8) == [chunks]


# Fault isolation -------------------------------------------------------------------------------------------------


async def test_a_poisoned_request_fails_alone_and_its_batch_mates_succeed() -> None:
    runner = Runner()
    batcher = await started(Batcher(runner, max_batch_size=8, max_delay=0.05, max_queue_rows=64))
    inputs = [rows(1, i * 10) for i in range(7)]
    inputs.insert(3, poisoned())
    results = await asyncio.gather(*(batcher.infer(x) for x in inputs), return_exceptions=True)
    assert runner.sizes[0] == 8  # they did share one batch
    for i, (x, r) in enumerate(zip(inputs, results, strict=True)):
        if i == 3:
            assert isinstance(r, BatchFailedError)
            assert "ValueError: poisoned row" in str(r)
        else:
            assert isinstance(r, np.ndarray), r
            np.testing.assert_array_equal(r, x * 2)
    # Bisection: 8 -> 4 + 4; the failing 4 -> 2 + 2; the failing 2 -> 1 + 1, and the poisoned row fails alone.
    assert runner.sizes == [8, 4, 2, 2, 1, 1, 4]
    assert batcher.stats.split_retries == 3
    assert batcher.stats.succeeded == 7
    await batcher.stop()


async def test_two_poisoned_requests_in_one_batch_both_fail_and_nothing_else_does() -> None:
    runner = Runner()
    batcher = await started(Batcher(runner, max_batch_size=4, max_delay=0.05, max_queue_rows=64))
    inputs = [poisoned(), rows(1), rows(2, 7), poisoned()]
    results = await asyncio.gather(*(batcher.infer(x) for x in inputs), return_exceptions=True)
    assert [type(r).__name__ for r in results] == ["BatchFailedError", "ndarray", "ndarray", "BatchFailedError"]
    np.testing.assert_array_equal(results[2], rows(2, 7) * 2)
    await batcher.stop()


class Killing(Runner):
    """A runner whose instance dies for a batch holding a poisoned row (an instance process killed by it), or that has
    no instance to take a batch while ``restarting`` (every instance process restarting)."""

    restarting = False

    async def __call__(self, chunks: list[np.ndarray]) -> list[Outcome]:
        self.sizes.append(sum(len(c) for c in chunks))
        if self.restarting:
            raise ModelNotReadyError("model 'm' has no instance process able to serve (restarting)")
        if any((c == POISON).any() for c in chunks):
            raise InstanceLostError("instance process 0 of model 'm' (pid 1) exited")
        return [c * 2 for c in chunks]


async def test_a_batch_that_killed_its_instance_is_rerun_a_request_at_a_time() -> None:
    runner = Killing()
    batcher = await started(Batcher(runner, max_batch_size=8, max_delay=0.05, max_queue_rows=64))
    inputs = [rows(1, i) for i in range(8)]
    inputs[2] = poisoned()
    results = await asyncio.gather(*(batcher.infer(x) for x in inputs), return_exceptions=True)
    assert [type(r).__name__ for r in results] == ["ndarray"] * 2 + ["BatchFailedError"] + ["ndarray"] * 5
    assert "InstanceLostError: instance process 0 of model 'm' (pid 1) exited" in str(results[2])
    # In halves, 4 of the rerun batches would hold the killer (8, 4, 2, 1); a request at a time, it runs alone once.
    assert runner.sizes == [8] + [1] * 8
    assert batcher.stats.split_retries == 1
    await batcher.stop()


async def test_a_batch_no_instance_can_take_fails_its_requests_to_be_sent_again_without_splitting() -> None:
    runner = Killing()
    runner.restarting = True
    batcher = await started(Batcher(runner, max_batch_size=8, max_delay=0.05, max_queue_rows=64))
    results = await asyncio.gather(*(batcher.infer(rows(1, i)) for i in range(4)), return_exceptions=True)
    assert all(isinstance(r, ModelNotReadyError) and r.retry for r in results), results
    assert runner.sizes == [4]
    assert batcher.stats.split_retries == 0
    runner.restarting = False
    np.testing.assert_array_equal(await batcher.infer(rows(2)), rows(2) * 2)
    await batcher.stop()


async def test_a_request_spanning_batches_fails_whole_when_one_of_its_rows_is_poisoned() -> None:
    runner = Runner()
    batcher = await started(Batcher(runner, max_batch_size=4, max_delay=0.0, max_queue_rows=64))
    x = rows(10)
    x[6] = POISON  # in the second of its three batches
    with pytest.raises(BatchFailedError, match="poisoned row"):
        await batcher.infer(x)
    await asyncio.sleep(0.01)
    assert batcher.queued_rows == 0  # its third batch's rows were taken out, not run
    assert sum(runner.sizes) == 8
    np.testing.assert_array_equal(await batcher.infer(rows(2)), rows(2) * 2)
    await batcher.stop()


async def test_per_chunk_errors_from_the_runner_fail_only_that_request() -> None:
    async def runner(chunks: list[np.ndarray]) -> list[Outcome]:
        return [RuntimeError("bad chunk") if (c == POISON).any() else Output(c + 1, "fp16") for c in chunks]

    batcher = await started(Batcher(runner, max_batch_size=8, max_delay=0.05, max_queue_rows=64))
    good, bad = await asyncio.gather(batcher.enqueue(rows(2)), batcher.infer(poisoned()), return_exceptions=True)
    assert isinstance(bad, BatchFailedError)
    assert "RuntimeError: bad chunk" in str(bad)
    assert good.precisions == ("fp16",)  # type: ignore[union-attr]
    np.testing.assert_array_equal(good.data, rows(2) + 1)  # type: ignore[union-attr]
    assert batcher.stats.split_retries == 0  # no rerun needed: the runner named the failing chunk itself
    await batcher.stop()


# Out of memory ---------------------------------------------------------------------------------------------------


async def test_out_of_memory_halves_the_batch_size_for_good_and_every_request_succeeds() -> None:
    runner = Runner(oom_above=3)
    batcher = await started(Batcher(runner, max_batch_size=16, max_delay=0.05, max_queue_rows=64))
    inputs = [rows(1, i) for i in range(12)] + [rows(4, 100)]
    results = await asyncio.gather(*(batcher.infer(x) for x in inputs))
    for x, r in zip(inputs, results, strict=True):
        np.testing.assert_array_equal(r, x * 2)
    assert batcher.max_batch_size == 2  # 16 rows failed -> 8 -> 4 -> 2
    assert batcher.configured_max_batch_size == 16
    assert batcher.stats.oom_shrinks == 3
    assert max(batcher.stats.batch_sizes) <= 3
    # Remembered: later batches are cut at the new size without failing first.
    failed = batcher.stats.failed_batches
    await asyncio.gather(*(batcher.infer(rows(1, i)) for i in range(6)))
    assert batcher.stats.failed_batches == failed
    assert runner.sizes[-3:] == [2, 2, 2]
    await batcher.stop()


async def test_a_single_row_that_does_not_fit_fails_its_request_only() -> None:
    runner = Runner(oom_above=0)
    batcher = await started(Batcher(runner, max_batch_size=4, max_delay=0.0, max_queue_rows=64))
    with pytest.raises(BatchFailedError, match="even a single row does not fit"):
        await batcher.infer(rows(3))
    assert batcher.max_batch_size == 1
    await batcher.stop()


# Deadlines and admission -----------------------------------------------------------------------------------------


async def test_a_deadline_is_answered_on_time_while_the_runner_is_busy_and_the_request_never_runs() -> None:
    runner = Runner()
    runner.gate.clear()
    batcher = await started(Batcher(runner, max_batch_size=2, max_delay=0.0, max_queue_rows=64))
    busy = asyncio.ensure_future(batcher.infer(rows(2)))
    await runner.entered.wait()
    start = time.monotonic()
    with pytest.raises(DeadlineExceededError, match="while the request was queued"):
        await batcher.infer(rows(1, 50), deadline=time.monotonic() + 0.05)
    assert time.monotonic() - start < 1.0  # at its deadline, not when the busy batch ends
    assert batcher.queued_rows == 0
    assert batcher.stats.expired == 1
    runner.gate.set()
    await busy
    await asyncio.sleep(0.01)
    assert runner.sizes == [2]  # the expired request never ran
    await batcher.stop()


async def test_a_deadline_passing_while_a_request_is_partly_taken_answers_at_once_and_drops_its_rest() -> None:
    runner = Runner()
    runner.gate.clear()
    batcher = await started(Batcher(runner, max_batch_size=4, max_delay=0.0, max_queue_rows=64))
    big = asyncio.ensure_future(batcher.infer(rows(10), deadline=time.monotonic() + 0.05))
    await runner.entered.wait()  # its first 4 rows are running
    other = asyncio.ensure_future(batcher.infer(rows(2, 1000)))  # queued behind it, with no deadline
    with pytest.raises(DeadlineExceededError, match=r"4 of its 10 rows had started"):
        await big
    assert batcher.queued_rows == 2  # only the other request's rows are left
    runner.gate.set()
    np.testing.assert_array_equal(await other, rows(2, 1000) * 2)
    assert runner.sizes == [4, 2]  # big's first batch finished (and was discarded), none of its other rows ran
    assert batcher.stats.expired == 1
    await batcher.stop()


async def test_a_request_whose_rows_all_started_is_left_to_finish() -> None:
    runner = Runner()
    runner.gate.clear()
    batcher = await started(Batcher(runner, max_batch_size=4, max_delay=0.0, max_queue_rows=64))
    fut = asyncio.ensure_future(batcher.infer(rows(3), deadline=time.monotonic() + 0.02))
    await runner.entered.wait()
    await asyncio.sleep(0.05)  # past the deadline, with every row in the running batch
    runner.gate.set()
    np.testing.assert_array_equal(await fut, rows(3) * 2)
    assert batcher.stats.expired == 0
    await batcher.stop()


class Held(HeldAnswer):
    """An answer the runner holds until the test says an instance took its batch (as instance processes hold one
    while every process restarts)."""

    __slots__ = ("chunks", "taken")

    def __init__(self, chunks: list[np.ndarray]) -> None:
        super().__init__(loop=asyncio.get_running_loop())
        self.chunks, self.taken = chunks, False

    def started(self) -> bool:
        return self.taken

    def run(self) -> None:
        self.taken = True
        self.set_result([c * 2 for c in self.chunks])


class Holding:
    """A runner whose every batch waits in a :class:`Held` answer."""

    def __init__(self) -> None:
        self.held: list[Held] = []

    def __call__(self, chunks: list[np.ndarray]) -> Held:
        self.held.append(Held(chunks))
        return self.held[-1]


async def test_a_deadline_passing_while_the_runner_holds_the_batch_answers_as_queued_and_the_batch_goes_on() -> None:
    runner = Holding()
    batcher = await started(Batcher(runner, max_batch_size=4, max_delay=0.0, max_queue_rows=64))
    timed = batcher.enqueue(rows(2), deadline=time.monotonic() + 0.05)
    plain = batcher.enqueue(rows(1, 100))  # no deadline: in the same batch
    await until(timed.done, "answered at its deadline, with its batch still held: it had not started")
    with pytest.raises(DeadlineExceededError) as caught:
        timed.result()
    assert str(caught.value) == "deadline passed while the request was queued"
    [held] = runner.held
    assert [len(c) for c in held.chunks] == [2, 1]
    assert not plain.done()
    held.run()  # an instance takes the batch: the other request is answered, the expired one's outputs discarded
    np.testing.assert_array_equal((await plain).data, rows(1, 100) * 2)
    assert batcher.stats.expired == 1
    await batcher.stop()


async def test_a_request_with_rows_taken_and_rows_held_counts_only_the_taken_as_started() -> None:
    runner = Holding()
    batcher = await started(Batcher(runner, max_batch_size=4, max_delay=0.0, max_queue_rows=64, concurrency=2))
    big = batcher.enqueue(rows(6), deadline=time.monotonic() + 0.05)
    await until(lambda: len(runner.held) == 2, "both batches handed to the runner")
    runner.held[0].taken = True  # its first 4 rows started; the other 2 wait for an instance
    await until(big.done, "answered at its deadline, 2 of its rows still held")
    with pytest.raises(DeadlineExceededError, match=r"4 of its 6 rows had started"):
        big.result()
    for held in runner.held:
        held.run()
    await batcher.stop()


async def test_a_request_whose_held_batch_an_instance_took_is_left_to_finish() -> None:
    runner = Holding()
    batcher = await started(Batcher(runner, max_batch_size=4, max_delay=0.0, max_queue_rows=64))
    fut = batcher.enqueue(rows(3), deadline=time.monotonic() + 0.02)
    await until(lambda: runner.held, "the batch handed to the runner")
    runner.held[0].taken = True
    await asyncio.sleep(0.05)  # past the deadline, with the batch taken
    runner.held[0].run()
    np.testing.assert_array_equal((await fut).data, rows(3) * 2)
    assert batcher.stats.expired == 0
    await batcher.stop()


async def test_a_request_larger_than_the_queue_is_refused_as_too_large_not_as_full() -> None:
    batcher = await started(Batcher(Runner(), max_batch_size=4, max_delay=0.0, max_queue_rows=8))
    with pytest.raises(RequestTooLargeError, match="9 rows; the queue holds at most 8"):
        await batcher.infer(rows(9))
    await batcher.stop()


async def test_precisions_of_a_request_spanning_batches_are_distinct_and_in_row_order() -> None:
    calls = 0

    async def runner(chunks: list[np.ndarray]) -> list[Outcome]:
        nonlocal calls
        calls += 1
        return [Output(c, "fp32" if calls == 2 else "fp16") for c in chunks]

    batcher = await started(Batcher(runner, max_batch_size=2, max_delay=0.0, max_queue_rows=64))
    result = await batcher.enqueue(rows(6))
    assert result.precisions == ("fp16", "fp32")
    np.testing.assert_array_equal(result.data, rows(6))
    assert (await batcher.enqueue(rows(1))).precisions == ("fp16",)
    await batcher.stop()


async def test_a_runner_breaking_its_contract_fails_the_request_and_never_strands_it() -> None:
    async def runner(chunks: list[np.ndarray]) -> list[Outcome]:
        return [None if (c == POISON).any() else c for c in chunks]  # type: ignore[misc]

    batcher = await started(Batcher(runner, max_batch_size=8, max_delay=0.05, max_queue_rows=64))
    good, bad = await asyncio.wait_for(
        asyncio.gather(batcher.infer(rows(1)), batcher.infer(poisoned()), return_exceptions=True), timeout=5
    )
    assert isinstance(bad, BatchFailedError)
    assert "runner returned NoneType, expected an array" in str(bad)
    np.testing.assert_array_equal(good, rows(1))
    await batcher.stop()
