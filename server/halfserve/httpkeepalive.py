"""A connection's keep-alive (:class:`KeepAlive`): how long it is kept open with no request on it, and how a drain
shortens that, for the HTTP protocol (:mod:`halfserve.httpprotocol`).

uvicorn arms a keep-alive timer after every response and cancels it when the next request's bytes arrive: a
call_later and a cancel per request. Here one timer covers a connection's idle stretches: when it fires it closes the
connection if it has been idle for the whole keep-alive timeout, and otherwise waits for the rest.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

DRAIN_IDLE_S = 1.0
"""In a drain, how long a connection with no request on it is kept open after its last answer (or since it was
opened), for the request its client may be writing: that request is answered, with ``connection: close``. uvicorn
closed such a connection at once, and a keep-alive client that had just written its next request on it lost it to a
reset (a ``ReadError``)."""


class KeepAlive:
    """The idle stretches of one connection: ``on_expired`` closes it once one has lasted ``timeout`` (from the
    connection's last answer, or since it was opened), or :data:`DRAIN_IDLE_S` in a drain if that is shorter."""

    def __init__(self, loop: asyncio.AbstractEventLoop, timeout: float, on_expired: Callable[[], None]) -> None:
        self.loop, self.timeout, self._on_expired = loop, timeout, on_expired
        self._timer: asyncio.TimerHandle | None = None
        self._idle_since: float | None = loop.time()
        """When the connection's last response went out (or it was opened) with no request after it; None while one
        is arriving."""
        self.draining = False
        """The server is shutting down: the request in progress, or the next one to arrive, is the last answered."""

    def busy(self) -> None:
        """Bytes arrived: the connection is busy until its next response (the timer, if armed, finds it so)."""
        self._idle_since = None

    def idle(self) -> None:
        """A response went out with no request after it: the connection is idle from now."""
        self._idle_since = self.loop.time()
        if self._timer is None:
            self._timer = self.loop.call_later(self._limit(), self._expired)

    def drain(self) -> None:
        """A drain began: an idle connection closes now if it has been idle :data:`DRAIN_IDLE_S` already, or else
        when it has; the next idle stretch is as short."""
        self.draining = True
        if self._idle_since is not None:
            self.stop()
            self._expired()

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _limit(self) -> float:
        return min(self.timeout, DRAIN_IDLE_S) if self.draining else self.timeout

    def _expired(self) -> None:
        self._timer = None
        if self._idle_since is None:
            return  # busy: its next response waits again
        left = self._idle_since + self._limit() - self.loop.time()
        if left > 0:
            self._timer = self.loop.call_later(left, self._expired)
        else:
            self._on_expired()
