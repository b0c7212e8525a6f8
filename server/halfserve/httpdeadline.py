"""A connection's read deadline (:class:`ReadDeadline`): how long its request's line and headers may take, and each gap
in its body and the body's average rate.

One timer serves both, and it is armed only for a request still incomplete when a read has been parsed: a request
that arrives whole in one read (nearly all of them) costs no timer at all.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable


class ReadDeadline:
    """The timer of a request still arriving: its head's (``header_timeout``, however many reads the head takes), or
    its body's: the gap from the last read (``body_timeout``) or the body's rate deadline, whichever comes first.

    A body must arrive at ``min_body_rate`` on average, after a first ``body_timeout`` that any body may take: a gap
    alone is no bound, as a byte every ``body_timeout`` would hold the connection for ever. ``on_head`` and
    ``on_body`` are called when the head's or the body's timer runs out (it is disarmed by then).
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        header_timeout: float,
        body_timeout: float,
        min_body_rate: int,
        on_head: Callable[[], None],
        on_body: Callable[[], None],
    ) -> None:
        self.loop = loop
        self.header_timeout, self.body_timeout, self.min_body_rate = header_timeout, body_timeout, min_body_rate
        self._on_head, self._on_body = on_head, on_body
        self._timer: asyncio.TimerHandle | None = None
        self.timing_head = False
        """The timer is the head's."""
        self._body_since: float | None = None
        """When the current body was first read incomplete (its rate is counted from then); None outside one."""
        self.body_bytes = 0
        """Bytes of the current body read so far."""
        self._cut_by_rate = False
        """The armed body timer is the body's rate deadline, not its gap."""

    def _arm(self, seconds: float, then: Callable[[], None]) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self.loop.call_later(seconds, then)
        self.timing_head = False

    def head(self) -> None:
        """A head began: it has ``header_timeout`` from now, however many reads it takes."""
        self._arm(self.header_timeout, self._head_expired)
        self.timing_head = True

    def body(self) -> None:
        """Bytes of a body arrived (counted in :attr:`body_bytes`): its timer is the gap from now or the body's rate
        deadline, whichever comes first."""
        now = self.loop.time()
        if self._body_since is None:
            self._body_since = now
        deadline = self._body_since + self.body_timeout + self.body_bytes / self.min_body_rate
        self._arm(min(self.body_timeout, max(deadline - now, 0.0)), self._body_expired)
        self._cut_by_rate = deadline - now < self.body_timeout

    def server_waits(self) -> None:
        """The body's timer ran out while the server was not reading it: the wait is the server's, so its rate is
        counted afresh, and the client has another ``body_timeout``."""
        self._body_since, self.body_bytes, self._cut_by_rate = None, 0, False
        self._arm(self.body_timeout, self._body_expired)

    def body_ended(self) -> None:
        """The body is whole (or refused): the timer is disarmed, and the next body's rate is counted afresh."""
        self.stop()
        self._body_since, self.body_bytes = None, 0

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.timing_head = False

    def body_refusal(self) -> tuple[str, bool]:
        """What the 408 of a body whose timer ran out says, and whether the client is still sending (then the
        connection lingers, so that the answer is not lost to a reset)."""
        if self._cut_by_rate:
            since = self.loop.time() - (self._body_since or 0.0)
            rate = self.min_body_rate
            return f"body: {self.body_bytes} bytes in {since:.0f} s, under {rate} bytes/s (min_body_rate)", True
        return f"body: no byte received for {self.body_timeout:g} s (body_timeout)", False

    def _head_expired(self) -> None:
        self._timer, self.timing_head = None, False
        self._on_head()

    def _body_expired(self) -> None:
        self._timer = None
        self._on_body()
