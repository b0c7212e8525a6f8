"""A connection's read deadline (:class:`halfserve.httpdeadline.ReadDeadline`) over a made-up clock: when a head's or
a body's timer runs out, and what a body's 408 says."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from halfserve.httpdeadline import ReadDeadline


@dataclass
class Timer:
    due: float
    then: Callable[[], None]
    cancelled: bool = False

    def cancel(self) -> None:
        self.cancelled = True


@dataclass
class Clock:
    """Enough of an event loop for the deadline: ``time`` and ``call_later``, run by :meth:`advance`."""

    now: float = 0.0
    timers: list[Timer] = field(default_factory=list)

    def time(self) -> float:
        return self.now

    def call_later(self, seconds: float, then: Callable[[], None]) -> Timer:
        timer = Timer(self.now + seconds, then)
        self.timers.append(timer)
        return timer

    def armed(self) -> list[Timer]:
        return [t for t in self.timers if not t.cancelled]

    def advance(self, seconds: float) -> None:
        self.now += seconds
        for timer in sorted(self.armed(), key=lambda t: t.due):
            if timer.due <= self.now and not timer.cancelled:
                timer.cancelled = True
                timer.then()


def deadline(clock: Clock, fired: list[str]) -> ReadDeadline:
    return ReadDeadline(
        clock,  # type: ignore[arg-type]
        header_timeout=10.0,
        body_timeout=5.0,
        min_body_rate=1000,
        on_head=lambda: fired.append("head"),
        on_body=lambda: fired.append("body"),
    )


def test_a_head_has_its_timeout_from_its_first_byte_however_many_reads_it_takes() -> None:
    clock, fired = Clock(), []
    read = deadline(clock, fired)
    read.head()
    assert read.timing_head
    clock.advance(9.9)
    assert fired == []
    clock.advance(0.2)
    assert fired == ["head"]
    assert not read.timing_head  # expired: a next head arms afresh


def test_a_body_gap_is_a_408_saying_no_byte_arrived_and_the_client_is_not_sending() -> None:
    clock, fired = Clock(), []
    read = deadline(clock, fired)
    read.body_bytes = 100
    read.body()
    clock.advance(4.9)
    assert fired == []
    clock.advance(0.2)
    assert fired == ["body"]
    assert read.body_refusal() == ("body: no byte received for 5 s (body_timeout)", False)


def test_a_trickling_body_is_cut_at_its_rate_deadline_however_short_its_gaps() -> None:
    clock, fired = Clock(), []
    read = deadline(clock, fired)
    for _ in range(5):  # 10 bytes a second, each gap well short of body_timeout
        read.body_bytes += 10
        read.body()
        clock.advance(1.0)
    # Due 5 s (body_timeout) after the first read, plus 50 bytes at 1000 bytes/s: 1.05 s after the last read.
    assert [t.due for t in clock.armed()] == [5.05]
    assert fired == []
    clock.advance(0.1)
    assert fired == ["body"]
    why, still_sending = read.body_refusal()
    assert why == "body: 50 bytes in 5 s, under 1000 bytes/s (min_body_rate)"
    assert still_sending  # lingers, so that the answer is not lost to a reset


def test_a_body_the_server_is_not_reading_counts_its_rate_afresh() -> None:
    clock, fired = Clock(), []
    read = deadline(clock, fired)
    read.body_bytes = 10
    read.body()
    clock.advance(5.0)
    read.server_waits()
    assert read.body_bytes == 0
    read.body_bytes = 2000
    read.body()  # the rate is counted from here: 5 s of grace again, plus 2 s for its 2000 bytes
    assert [t.due for t in clock.armed()] == [10.0]  # the gap (5 s) comes first


def test_a_whole_body_disarms_and_the_next_body_starts_from_nothing() -> None:
    clock, fired = Clock(), []
    read = deadline(clock, fired)
    read.body_bytes = 100
    read.body()
    read.body_ended()
    assert clock.armed() == []
    assert read.body_bytes == 0
    clock.advance(60.0)
    assert fired == []
