"""The admin token's lockout: wrong tokens counted per client address and in all, and past the limit answered slowly
(a tarpit), kept per app by the routes."""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable

from halfserve.serving import AppState


class FailedAttempts:
    """Wrong admin tokens, per client address and from every address together. Past ``limit`` in ``window`` seconds
    from one address, or past ``total`` from all of them, a wrong token is answered 429 rather than 401 until the
    oldest of those failures leaves the window (and each further one keeps it shut).

    The right token is not refused (unless its own address has a full :class:`Tarpit` of wrong ones waiting): the
    operator who shares an address with a guesser (a NAT, a proxy, a
    shared-memory client on the same host) is not locked out by that guesser, nor by their own typo. So this bounds
    and reports guessing rather than preventing it; the token's length (at least 16 characters) is what makes guessing
    hopeless. At most ``addresses`` are remembered (the longest quiet ones are forgotten first), each with its last
    ``limit`` failures, so the tables stay small whoever sends them."""

    def __init__(
        self,
        limit: int = 10,
        window: float = 60.0,
        addresses: int = 4096,
        total: int = 100,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.limit, self.window, self.addresses, self.total, self.clock = limit, window, addresses, total, clock
        self.failures: OrderedDict[str, deque[float]] = OrderedDict()
        self.everyone: deque[float] = deque(maxlen=total)
        """The last ``total`` failures, from whichever address."""

    def retry_after(self, who: str) -> float:
        """Seconds until a wrong token from ``who`` is answered 401 again; 0 when it is now."""
        times = self.failures.get(who)
        now = self.clock()
        if times is not None and (not times or times[-1] <= now - self.window):
            del self.failures[who]
            times = None
        mine = self._locked_for(times, self.limit, now) if times is not None else 0.0
        return max(mine, self.retry_after_all())

    def retry_after_all(self) -> float:
        """Seconds until a wrong token from an address with no failures of its own is answered 401 again."""
        return self._locked_for(self.everyone, self.total, self.clock())

    def _locked_for(self, times: deque[float], limit: int, now: float) -> float:
        if len(times) < limit:
            return 0.0
        oldest = times[-limit]
        return max(oldest + self.window - now, 0.0)

    def failed(self, who: str) -> None:
        now = self.clock()
        times = self.failures.get(who)
        if times is None:
            times = self.failures[who] = deque(maxlen=self.limit)
        times.append(now)
        self.everyone.append(now)
        self.failures.move_to_end(who)
        if len(self.failures) > self.addresses:
            self.failures.popitem(last=False)


class Tarpit:
    """Holds back the answers to wrong admin tokens past the lockout's limit: each answer waits ``delay`` seconds, and
    at most ``slots`` of one address wait at once (the others queue for a slot), so one address gets at most
    ``slots / delay`` answers a second however many guesses it sends at once; a 429 answered at once still told a
    guesser the token was wrong, at 678 guesses a second.

    A held answer is a sleeping coroutine (no thread, the event loop goes on), and an address's gate lives only while
    one of its answers waits. At most ``queue`` of one address wait (:meth:`full`): past that its admin calls are
    refused at once, the token unread, so a flood of guesses holds neither more connections than that (each for
    ``queue * delay / slots`` seconds at most) nor learns anything from the refusal."""

    def __init__(self, delay: float = 1.0, slots: int = 2, queue: int = 32) -> None:
        self.delay, self.slots, self.queue = delay, slots, queue
        self.gates: dict[str, asyncio.Semaphore] = {}
        self.waiting: Counter[str] = Counter()

    def full(self, who: str) -> bool:
        """Whether ``who`` has ``queue`` answers waiting: its next admin call is refused before its token is read."""
        return self.waiting[who] >= self.queue if who in self.waiting else False

    def retry_after(self) -> int:
        """Seconds until a full queue of one address has been answered."""
        return math.ceil(self.queue * self.delay / self.slots)

    async def hold(self, who: str) -> None:
        """Return once the answer to ``who``'s wrong token may go."""
        gate = self.gates.setdefault(who, asyncio.Semaphore(self.slots))
        self.waiting[who] += 1
        try:
            async with gate:
                await asyncio.sleep(self.delay)
        finally:
            self.waiting[who] -= 1
            if not self.waiting[who]:
                del self.waiting[who], self.gates[who]


def tarpit(app: AppState) -> Tarpit:
    """``app``'s tarpit (made on first use, as :func:`attempts`)."""
    found = app.route_state.get(Tarpit)
    if not isinstance(found, Tarpit):
        found = app.route_state[Tarpit] = Tarpit()
    return found


def attempts(app: AppState) -> FailedAttempts:
    """``app``'s lockout (made on first use: the routes keep it, the contract only holds it for them)."""
    found = app.route_state.get(FailedAttempts)
    if not isinstance(found, FailedAttempts):
        found = app.route_state[FailedAttempts] = FailedAttempts()
    return found
