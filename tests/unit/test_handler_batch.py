"""The handler batcher alone (issue 51): a fake handler run and a made-up clock, no torch, no server. Batches form
by size and delay in arrival order, a batch that fails for one request is rerun one request per call, and the queue,
deadlines and callers that leave are bounded."""

from __future__ import annotations

import asyncio

import pytest

from halfserve.errors import DeadlineExceededError, InternalError, QueueFullError, RequestTooLargeError
from halfserve.handlerbatch import HandlerBatcher
from tests.unit.test_batching import FakeClock, settle

Job = tuple[str, ...]
"""A request's payloads: strings; ``"bad"`` makes the fake handler raise, as a payload it cannot parse would."""


class FakeHandler:
    """Answers each payload with its upper case; records each call's jobs and time left; can be held at a gate."""

    def __init__(self) -> None:
        self.calls: list[list[Job]] = []
        self.timeouts: list[float | None] = []
        self.gate = asyncio.Event()
        self.gate.set()
        self.short = False
        """Return one result too few, as a handler returning the wrong number of answers."""

    async def __call__(self, jobs: list[Job], timeout: float | None) -> list[list[str]]:
        self.calls.append(jobs)
        self.timeouts.append(timeout)
        await self.gate.wait()
        if any("bad" in job for job in jobs):
            raise ValueError("handler preprocess failed: ValueError: 'bad' is not a number")
        if self.short and len(jobs) > 1:
            return [[p.upper() for p in job] for job in jobs[1:]]
        return [[p.upper() for p in job] for job in jobs]


def _alone(e: BaseException) -> bool:
    return isinstance(e, ValueError | InternalError)


def _bytes(job: Job) -> int:
    return sum(len(p) for p in job)


def batcher(
    handler: FakeHandler,
    clock: FakeClock,
    *,
    max_batch_size: int = 4,
    queue: int = 8,
    concurrency: int = 1,
    queue_bytes: int | None = None,
) -> HandlerBatcher[Job, list[str]]:
    return HandlerBatcher(
        handler,
        size=len,
        weight=_bytes,
        alone=_alone,
        max_batch_size=max_batch_size,
        max_delay=0.010,
        max_queue_payloads=queue,
        concurrency=concurrency,
        max_queue_bytes=queue_bytes,
        clock=clock,
    )


async def test_requests_within_the_delay_are_one_call_in_arrival_order() -> None:
    handler, clock = FakeHandler(), FakeClock()
    b = batcher(handler, clock, max_batch_size=5)
    futures = [b.submit(("a",)), b.submit(("b", "c")), b.submit(("d",))]
    await settle()
    assert handler.calls == []  # 5 payloads fill the batch: 4 are queued
    await clock.advance(0.009)
    assert handler.calls == []
    await clock.advance(0.001)
    assert handler.calls == [[("a",), ("b", "c"), ("d",)]]
    assert [f.result() for f in futures] == [["A"], ["B", "C"], ["D"]]
    assert b.batch_sizes == [4]


async def test_a_full_batch_runs_at_once_and_a_request_is_never_split() -> None:
    handler, clock = FakeHandler(), FakeClock()
    b = batcher(handler, clock, max_batch_size=3)
    futures = [b.submit(("a", "b")), b.submit(("c", "d")), b.submit(("e",)), b.submit(("f", "g", "h", "i"))]
    await settle()
    # The first two do not fit in 3 together; a request over the batch size runs alone.
    assert handler.calls == [[("a", "b")], [("c", "d"), ("e",)], [("f", "g", "h", "i")]]
    assert b.batch_sizes == [2, 3, 4]
    assert futures[3].result() == ["F", "G", "H", "I"]


async def test_a_failing_batch_is_rerun_one_request_per_call() -> None:
    handler, clock = FakeHandler(), FakeClock()
    b = batcher(handler, clock)
    good, bad, other = b.submit(("a",)), b.submit(("bad",)), b.submit(("c", "d"))
    await settle()
    # Rerun one by one, the lightest (fewest bytes) first.
    assert handler.calls == [[("a",), ("bad",), ("c", "d")], [("a",)], [("c", "d")], [("bad",)]]
    assert good.result() == ["A"]
    assert other.result() == ["C", "D"]
    with pytest.raises(ValueError, match="'bad' is not a number"):
        bad.result()


@pytest.mark.parametrize("concurrency", [1, 3])
async def test_reruns_go_lightest_first(concurrency: int) -> None:
    """A light request caught in a batch with heavy ones is run again before them, one at a time whether or not other
    batches may run beside."""
    handler, clock = FakeHandler(), FakeClock()
    b = batcher(handler, clock, max_batch_size=8, concurrency=concurrency)
    heavy_job, bad_job = ("x" * 50, "y" * 50), ("bad", "z" * 20)
    heavy, bad, light = b.submit(heavy_job), b.submit(bad_job), b.submit(("a",))
    await clock.advance(0.010)
    assert handler.calls == [[heavy_job, bad_job, ("a",)], [("a",)], [bad_job], [heavy_job]]
    assert light.result() == ["A"]
    assert heavy.result() == ["X" * 50, "Y" * 50]
    with pytest.raises(ValueError, match="'bad' is not a number"):
        bad.result()


async def test_the_wrong_number_of_results_is_rerun_alone() -> None:
    handler, clock = FakeHandler(), FakeClock()
    handler.short = True
    b = batcher(handler, clock, max_batch_size=2)
    first, second = b.submit(("a",)), b.submit(("b",))
    await settle()
    assert handler.calls == [[("a",), ("b",)], [("a",)], [("b",)]]
    assert (first.result(), second.result()) == (["A"], ["B"])


async def test_a_failure_no_request_caused_fails_the_batch_without_reruns() -> None:
    async def busy(jobs: list[Job], timeout: float | None) -> list[list[str]]:
        calls.append(jobs)
        raise QueueFullError("handler calls are all busy")

    calls: list[list[Job]] = []
    b = HandlerBatcher(  # no clock: the loop's own, as the server runs it
        busy, size=len, alone=_alone, max_batch_size=2, max_delay=1, max_queue_payloads=4, concurrency=1
    )
    futures = [b.submit(("a",)), b.submit(("b",))]
    await settle()
    assert calls == [[("a",), ("b",)]]
    for f in futures:
        with pytest.raises(QueueFullError):
            f.result()


async def test_reruns_stop_at_a_failure_no_request_caused_and_the_rest_hear_it() -> None:
    """A batch failed by a hung call is rerun one request at a time; once a rerun is refused for what no request did
    (every handler thread held by calls past their limit), the rest had waited their turns, a time limit each, to
    hear the same (a request 122 s behind 8 hung ones): they hear it at once."""
    calls: list[list[Job]] = []

    async def hung(jobs: list[Job], timeout: float | None) -> list[list[str]]:
        calls.append(jobs)
        if len(jobs) > 1:
            raise ValueError("handler preprocess ran past its time limit")  # one of them hung: alone may tell
        raise QueueFullError("handler calls are all busy")

    b = HandlerBatcher(hung, size=len, alone=_alone, max_batch_size=3, max_delay=1, max_queue_payloads=4, concurrency=1)
    futures = [b.submit(("a",)), b.submit(("bb",)), b.submit(("ccc",))]
    await settle()
    assert calls == [[("a",), ("bb",), ("ccc",)], [("a",)]]
    for f in futures:
        with pytest.raises(QueueFullError, match="all busy"):
            f.result()


async def test_the_queue_is_bounded_in_payloads() -> None:
    handler, clock = FakeHandler(), FakeClock()
    handler.gate.clear()
    b = batcher(handler, clock, max_batch_size=2, queue=3)
    b.submit(("a", "b"))  # runs, held at the gate: it leaves the queue
    await settle()
    b.submit(("c", "d"))
    with pytest.raises(QueueFullError, match=r"2 of 3 payloads queued, request has 2"):
        b.submit(("e", "f"))
    with pytest.raises(RequestTooLargeError, match="at most 3"):
        b.submit(("1", "2", "3", "4"))
    b.submit(("e",))  # what fits is taken
    assert b.queued_payloads == 3
    handler.gate.set()
    await settle()
    assert handler.calls[1] == [("c", "d")]
    await clock.advance(0.010)  # the lone request left waits out the delay
    assert handler.calls[2] == [("e",)]
    assert b.queued_payloads == 0


async def test_payload_bytes_are_bounded_from_arrival_until_the_batch_is_over() -> None:
    handler, clock = FakeHandler(), FakeClock()
    handler.gate.clear()
    b = batcher(handler, clock, max_batch_size=2, queue=8, queue_bytes=100)
    running, gone = b.submit(("a" * 30,)), b.submit(("b" * 30,))  # a batch of two, held at the gate
    await settle()
    assert (b.queued_payloads, b.held_bytes) == (0, 60)  # out of the queue, still held
    gone.cancel()  # its client left: its bytes stay with the running batch
    await settle()
    assert b.held_bytes == 60
    queued = b.submit(("c" * 40,))
    full = r"handler queue full \(100 bytes of payloads queued or running, request has 1; at most 100: handler_queue"
    with pytest.raises(QueueFullError, match=full):
        b.submit(("d",))
    with pytest.raises(RequestTooLargeError, match=r"request has 101 bytes of payloads; .* at most 100 \(handler_q"):
        b.submit(("e" * 101,))
    queued.cancel()  # withdrawn from the queue: its bytes are free at once
    await settle()
    assert b.held_bytes == 60
    b.also_held = lambda: 1  # a call past its limit still reading a byte of payloads
    with pytest.raises(QueueFullError, match=r"\(61 bytes of payloads queued or running, request has 40"):
        b.submit(("f" * 40,))
    b.also_held = lambda: 0
    later = b.submit(("f" * 40,))
    handler.gate.set()
    await settle()
    await clock.advance(0.010)
    assert running.result() == ["A" * 30]
    assert later.result() == ["F" * 40]
    assert b.held_bytes == 0


async def test_batches_in_flight_are_bounded_and_requests_gather_meanwhile() -> None:
    handler, clock = FakeHandler(), FakeClock()
    handler.gate.clear()
    b = batcher(handler, clock, concurrency=2)
    b.submit(("a",))
    await clock.advance(0.010)
    b.submit(("b",))
    await clock.advance(0.010)
    futures = [b.submit((p,)) for p in "cdef"[:3]]
    await clock.advance(0.050)
    assert handler.calls == [[("a",)], [("b",)]]  # two running: the rest wait past the delay
    handler.gate.set()
    await settle()
    assert handler.calls[2] == [("c",), ("d",), ("e",)]
    assert [f.result() for f in futures] == [["C"], ["D"], ["E"]]


async def test_a_deadline_answers_a_queued_request_and_bounds_its_batch() -> None:
    handler, clock = FakeHandler(), FakeClock()
    handler.gate.clear()
    b = batcher(handler, clock, max_batch_size=1)
    b.submit(("a",))  # runs, held
    await settle()
    late = b.submit(("b",), deadline=clock.now() + 0.5)
    kept = b.submit(("c",), deadline=clock.now() + 5.0)
    await clock.advance(1.0)
    with pytest.raises(DeadlineExceededError, match="while the request was queued"):
        late.result()
    handler.gate.set()
    await settle()
    assert handler.calls == [[("a",)], [("c",)]]  # the expired request never ran
    assert handler.timeouts == [None, pytest.approx(4.0)]
    assert kept.result() == ["C"]


async def test_a_caller_that_leaves_is_withdrawn_or_its_answer_dropped() -> None:
    handler, clock = FakeHandler(), FakeClock()
    handler.gate.clear()
    b = batcher(handler, clock, max_batch_size=2)
    running, companion = b.submit(("a",)), b.submit(("b",))
    await settle()
    queued = b.submit(("c",))
    queued.cancel()
    running.cancel()  # the client went away while its batch runs
    await settle()
    assert b.queued_payloads == 0
    handler.gate.set()
    await settle()
    assert companion.result() == ["B"]
    assert handler.calls == [[("a",), ("b",)]]  # the withdrawn request never ran


async def test_a_deadline_passing_while_the_model_holds_the_batch_answers_as_queued_and_the_batch_goes_on() -> None:
    """A batch the model holds before an instance takes it (every instance process restarting): the request whose
    deadline passes is answered as a queued one at its deadline, the other gets its answer once the batch runs; once
    taken, a request is left to finish past its deadline."""
    handler, clock = FakeHandler(), FakeClock()
    handler.gate.clear()
    taken: set[Job] = set()
    b = HandlerBatcher(
        handler,
        size=len,
        alone=_alone,
        max_batch_size=2,
        max_delay=0.010,
        max_queue_payloads=8,
        concurrency=1,
        held=lambda job: job not in taken,
        clock=clock,
    )
    timed, plain = b.submit(("a",), deadline=clock.now() + 0.3), b.submit(("b",))
    await settle()
    assert handler.calls == [[("a",), ("b",)]]  # one batch, held
    await clock.advance(0.3)
    with pytest.raises(DeadlineExceededError, match="^deadline passed while the request was queued$"):
        timed.result()
    assert not plain.done()
    left = b.submit(("c",), deadline=clock.now() + 0.3)
    taken.add(("c",))  # an instance takes its batch as soon as it runs
    handler.gate.set()
    await settle()
    assert plain.result() == ["B"]
    handler.gate.clear()
    await settle()
    await clock.advance(1.0)
    assert not left.done()  # taken: left to finish
    handler.gate.set()
    await settle()
    assert left.result() == ["C"]
