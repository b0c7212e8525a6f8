"""How many connections an HTTP server keeps open: ``max_connections`` admitted, and past them
:data:`PROBE_CONNECTIONS` more read only for a health or readiness probe, so a cap held by slow clients does not fail
the orchestrator's probes (:mod:`halfserve.httpprotocol` answers any other request on them 503)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

PROBE_CONNECTIONS = 32
"""Connections past ``max_connections`` read for a probe (a place each; when they are all taken, the one waiting
longest for its request's head gives its place up with a 503): a probe's head arrives in its first packet, so a
client holding these places with silent connections delays a probe by a round trip at most."""


class Connection(Protocol):
    """A connection as the census sees it."""

    @property
    def cycle(self) -> Any:
        """Its request in progress, None while it waits for one's head."""
        ...

    def refuse_busy(self) -> None:
        """Answer 503 (``max_connections``) and close; its place is left (:meth:`Census.leave`) as it closes."""
        ...


@dataclass
class Census:
    """A server's connections, as its protocol counts them for the cap."""

    max_connections: int
    admitted: set[Connection] = field(default_factory=set)
    """Connections under ``max_connections`` (a refused one, closing, until it is closed)."""
    standby: dict[Connection, None] = field(default_factory=dict)
    """Connections past it, waiting for a probe's head or answering it, oldest first."""

    def admit(self, connection: Connection) -> bool | None:
        """A new connection's place: True under the cap, False on standby (read for a probe only), None where every
        standby place is answering a probe (it is then refused). A full standby gives the place of the connection
        waiting longest for its request's head to the new one."""
        if len(self.admitted) < self.max_connections:
            self.admitted.add(connection)
            return True
        if len(self.standby) >= PROBE_CONNECTIONS:
            waiting = next((c for c in self.standby if c.cycle is None), None)
            if waiting is None:
                return None
            waiting.refuse_busy()
            self.standby.pop(waiting, None)
        self.standby[connection] = None
        return False

    def leave(self, connection: Connection) -> None:
        """The connection closed, or (on standby) is closing: its place is free."""
        self.admitted.discard(connection)
        self.standby.pop(connection, None)
