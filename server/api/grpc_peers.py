"""Connections per client address on the gRPC port (``grpc_peer_connections``).

grpcio caps connections only in all (``max_connections``) and tells the service nothing of a connection until it
makes a call, so a client holding every connection idle keeps every other client out. The cap per address is kept by
looking instead: every :data:`CHECK_EVERY` seconds the process's sockets on the gRPC port are listed (Linux's
``/proc/self/fd``), and an address's newest connections past the cap are shut down, which grpcio then closes as if
the client had. Where there is no ``/proc`` the cap is not kept.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from pathlib import Path

log = logging.getLogger(__name__)

CHECK_EVERY = 0.5
"""Seconds between two looks at the connections: how long an address may hold more than its cap."""
FDS = Path("/proc/self/fd")

Key = tuple[int, str, int]
"""A connection: its descriptor in this process, the client's address and port."""


def _peer(fd: int, port: int) -> tuple[str, int] | None:
    """The client address and port of descriptor ``fd`` where it is a connection to local ``port``."""
    try:
        if not os.readlink(FDS / str(fd)).startswith("socket:"):
            return None
        with socket.socket(fileno=os.dup(fd)) as s:  # a duplicate: closing it leaves grpcio's open
            if s.type != socket.SOCK_STREAM or s.getsockname()[1] != port:
                return None
            host, peer_port = s.getpeername()[:2]
    except (OSError, ValueError, IndexError):  # closed meanwhile, a listening socket, not an internet one
        return None
    return str(host), int(peer_port)


def _shut(key: Key, port: int) -> None:
    fd, host, peer_port = key
    with contextlib.suppress(OSError), socket.socket(fileno=os.dup(fd)) as s:
        # Checked again on the duplicate, which holds this very socket: the descriptor may have been reused.
        if s.getsockname()[1] == port and tuple(s.getpeername()[:2]) == (host, peer_port):
            s.shutdown(socket.SHUT_RDWR)


class PeerConnections:
    """The gRPC port's connections by client address, those past ``per_peer`` shut down."""

    def __init__(self, port: int, per_peer: int) -> None:
        self.port, self.per_peer = port, per_peer
        self.seen: dict[Key, float] = {}
        """When each open connection was first seen: an address's newest go first."""

    def check(self) -> int:
        """Look once; the number of connections shut down."""
        try:
            fds = [int(name) for name in os.listdir(FDS)]
        except OSError:
            return 0
        now = time.monotonic()
        by_peer: dict[str, list[Key]] = {}
        seen: dict[Key, float] = {}
        for fd in fds:
            peer = _peer(fd, self.port)
            if peer is not None:
                key = (fd, *peer)
                seen[key] = self.seen.get(key, now)
                by_peer.setdefault(peer[0], []).append(key)
        self.seen = seen
        shut = 0
        for host, keys in by_peer.items():
            if len(keys) > self.per_peer:
                keys.sort(key=seen.__getitem__)
                for key in keys[self.per_peer :]:
                    _shut(key, self.port)
                shut += len(keys) - self.per_peer
                log.info(
                    "gRPC: %d connections from %s past grpc_peer_connections closed", len(keys) - self.per_peer, host
                )
        return shut

    async def run(self) -> None:
        """Look every :data:`CHECK_EVERY` seconds until cancelled (off the event loop: a look reads every
        descriptor)."""
        if not FDS.is_dir():
            return
        while True:
            await asyncio.to_thread(self.check)
            await asyncio.sleep(CHECK_EVERY)
