"""The memory that HTTP request bodies still arriving may hold in one process, shared fairly between clients.

Each connection is held to a body's size (``max_body_bytes``) and a rate (``min_body_rate``), but alone those bound
nothing in all: twenty connections each sending a 50 MB body at the minimum rate hold a gigabyte for most of an hour.
So the bytes of every body not yet whole are counted here as they arrive (``http_pending_bytes``), those of one
client address at most a share of them (``http_peer_share``), as gRPC counts the calls receiving their message
(:mod:`halfserve.api.grpc.grpc_limits`). A body is counted until it is whole (the request is then the queue's to
bound) or its connection ends.

HTTP shows every byte as it comes, so a body counts what it has sent, not what it says it will, and a trickling body
holds little. When the budget is full, the body arriving slowest that has arrived for at least :data:`GRACE_S` gives
its bytes up to one that needs them (it is answered 503 and closed): a client filling the budget with slow bodies
from many addresses loses them before anyone's fast request is refused. Only where no body is that slow is the body
asking refused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

GRACE_S = 0.5
"""How long a body arrives before it may give its bytes up to another: a client's body follows its headers, so a
fast one is whole long before. Short, as it is what a client holding the budget must beat: one that reconnects to
keep its bodies younger than this must send the whole budget (256 MiB by default) every half second, 4 Gbit/s."""


class Body(Protocol):
    """A request body arriving on one connection, as the budget sees it."""

    peer: str
    """The client's address, whose bodies share ``http_peer_share``."""
    pending: int
    """Bytes of it counted here."""
    arriving_since: float
    """When its first byte was counted (the loop's clock)."""

    def paused(self) -> bool:
        """Whether the server stopped reading it (its app has not taken what arrived): its rate is then the server's."""
        ...

    def give_up(self, why: str) -> None:
        """Answer the request 503 with ``why`` and close its connection: its bytes went to another body."""
        ...


@dataclass(frozen=True)
class Refusal:
    """A body that may not have the bytes it received: the status to answer and why."""

    status: int
    message: str


@dataclass
class BodyBudget:
    """The bytes of bodies still arriving in one server, ``total`` at most, ``per_peer`` of them from one address."""

    total: int
    per_peer: int
    grace: float = GRACE_S
    held: int = 0
    by_peer: dict[str, int] = field(default_factory=dict)
    bodies: dict[Body, None] = field(default_factory=dict)
    """Bodies holding bytes, the first to arrive first."""

    @classmethod
    def of(cls, pending_bytes: int, peer_share: float) -> BodyBudget:
        """The budget of the settings ``http_pending_bytes`` and ``http_peer_share``."""
        return cls(pending_bytes, max(1, math.floor(pending_bytes * peer_share)))

    def claim(self, body: Body, size: int, now: float) -> Refusal | None:
        """Count ``size`` more bytes of ``body``, received at ``now``; a refusal where they are over its address's
        share or the budget and no other body, slow and arriving for long enough, gives its bytes up. Bodies give
        their bytes up only where that makes room: judged first as :meth:`ask` judges."""
        tight = self.held + size > self.total or self.by_peer.get(body.peer, 0) + size > self.per_peer
        if tight and (refusal := self._judge(body, size, now, [])) is not None:
            return refusal  # judged once more only where some body might give way: not on the common path
        return self._judge(body, size, now, None)

    def ask(self, body: Body, size: int, now: float) -> Refusal | None:
        """The refusal ``claim`` would answer were all ``size`` bytes of ``body`` to arrive at ``now``, with nothing
        counted or given up: for a request that declares its length and waits to be told to send it (``Expect:
        100-continue``), which is then refused before it sends anything. The bodies that would give way count as
        room; they give it up only once bytes that need it arrive."""
        return self._judge(body, size, now, [])

    def _judge(self, body: Body, size: int, now: float, spared: list[Body] | None) -> Refusal | None:
        """``claim`` (``spared`` None), or ``ask``: the bodies that would give way are listed in ``spared``, not
        given up, and nothing is counted."""
        if size <= 0:
            return None
        if body.pending + size > self.per_peer:  # never: a 413, not a refusal that retrying could lift
            return Refusal(
                413,
                f"body: more than {self.per_peer} bytes, the most one client address's bodies may hold while they "
                f"arrive (http_peer_share of http_pending_bytes)",
            )
        mine = self.by_peer.get(body.peer, 0)
        if mine + size > self.per_peer:
            ours = [b for b in self.bodies if b.peer == body.peer]
            if not self._make_room(ours, body, size, now, body.peer, spared):
                return Refusal(
                    429,
                    f"body: the requests of {body.peer} have {mine + size} bytes of bodies arriving, over "
                    f"{self.per_peer} (http_peer_share of http_pending_bytes)",
                )
        if not self._make_room(list(self.bodies), body, size, now, None, spared):
            return Refusal(
                503,
                f"server busy: {self.held} bytes of request bodies are arriving, and {size} more would pass "
                f"{self.total} (http_pending_bytes)",
            )
        if spared is not None:
            return None
        if body not in self.bodies:
            self.bodies[body] = None
            body.arriving_since = now
        body.pending += size
        self.held += size
        self.by_peer[body.peer] = self.by_peer.get(body.peer, 0) + size
        return None

    def release(self, body: Body) -> None:
        """The body is whole, refused, or its connection gone: its bytes are no longer counted."""
        if self.bodies.pop(body, 0) is None:
            self.held -= body.pending
            left = self.by_peer[body.peer] - body.pending
            if left:
                self.by_peer[body.peer] = left
            else:
                del self.by_peer[body.peer]
        body.pending = 0

    def _make_room(
        self, candidates: list[Body], asking: Body, size: int, now: float, peer: str | None, spared: list[Body] | None
    ) -> bool:
        """Whether ``size`` bytes fit under ``peer``'s share (the whole budget where None), once the slowest of
        ``candidates`` arriving for at least the grace have given theirs up, one at a time, the slowest first (or,
        where ``spared`` is a list, been added to it as if they had)."""
        limit = self.total if peer is None else self.per_peer
        gone = spared if spared is not None else []

        def used() -> int:
            taken = self.held if peer is None else self.by_peer.get(peer, 0)
            return taken - sum(b.pending for b in gone if peer is None or b.peer == peer)

        if used() + size <= limit:
            return True  # nearly every claim: no pass over the bodies
        late = [
            b
            for b in candidates
            if b is not asking and b not in gone and now - b.arriving_since >= self.grace and not b.paused()
        ]
        late.sort(key=lambda b: _rate(b, now))
        for victim in late:
            if used() + size <= limit:
                break
            if spared is not None:
                spared.append(victim)
                continue
            rate = _rate(victim, now)  # before its bytes are released
            self.release(victim)
            victim.give_up(
                f"server busy: this body arrived at {rate:.0f} bytes/s, and its bytes went to a faster one "
                f"(http_pending_bytes: {self.total} bytes of bodies may be arriving at once)"
            )
        return used() + size <= limit


def _rate(body: Body, now: float) -> float:
    """The bytes per second ``body`` has arrived at since its first byte counted."""
    return body.pending / max(now - body.arriving_since, 1e-9)
