"""Connections per client address on the gRPC port (``grpc_peer_connections``).

grpcio caps connections only in all (``max_connections``) and tells the service nothing of a connection until it
makes a call, so a client holding every connection idle keeps every other client out. The cap per address is kept by
looking instead: every :data:`CHECK_EVERY` seconds the connections to the gRPC port are listed (Linux's
``/proc/net/tcp``), and an address's newest past the cap are shut down, which grpcio then closes as if the client
had. Where there is no ``/proc`` the cap is not kept.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import socket
import sys
import time
from pathlib import Path

log = logging.getLogger(__name__)

CHECK_EVERY = 0.5
"""Seconds between two looks at the connections: how long an address may hold more than its cap."""
TABLES = (Path("/proc/net/tcp"), Path("/proc/net/tcp6"))
"""The kernel's TCP connections (of this network namespace), listed by one read each."""
FDS = Path("/proc/self/fd")
ESTABLISHED = "01"


def _address(hex_address: str) -> str:
    """An address as ``/proc/net/tcp*`` writes it (each 32-bit word in host order), IPv4-mapped ones as IPv4."""
    raw = bytes.fromhex(hex_address)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4)) if sys.byteorder == "little" else raw
    ip = ipaddress.ip_address(words)
    mapped = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) else None
    return str(mapped or ip)


def connections(port: int) -> dict[int, str]:
    """The established connections to local ``port``: each socket's inode and the client's address."""
    found: dict[int, str] = {}
    for table in TABLES:
        with contextlib.suppress(OSError):
            for line in table.read_text().splitlines()[1:]:
                fields = line.split()
                local, remote, state, inode = fields[1], fields[2], fields[3], int(fields[9])
                if state == ESTABLISHED and int(local.rpartition(":")[2], 16) == port:
                    found[inode] = _address(remote.rpartition(":")[0])
    return found


def _shut(inodes: set[int]) -> None:
    """Shut down this process's sockets of ``inodes`` (grpcio then closes each as if its client had)."""
    links = {f"socket:[{i}]" for i in inodes}
    for name in os.listdir(FDS):
        with contextlib.suppress(OSError, ValueError):
            if os.readlink(FDS / name) not in links:
                continue
            dup = os.dup(int(name))  # a duplicate holds the socket: the descriptor may be closed and reused meanwhile
            with socket.socket(fileno=dup) as s:
                if os.fstat(dup).st_ino in inodes:
                    s.shutdown(socket.SHUT_RDWR)


class PeerConnections:
    """The gRPC port's connections by client address, those past ``per_peer`` shut down."""

    def __init__(self, port: int, per_peer: int) -> None:
        self.port, self.per_peer = port, per_peer
        self.seen: dict[int, float] = {}
        """When each open connection (by inode) was first seen: an address's newest go first."""

    def check(self) -> int:
        """Look once; the number of connections shut down."""
        now = time.monotonic()
        try:
            if len(os.listdir(FDS)) <= self.per_peer:  # too few descriptors for any address to be past its cap
                self.seen = {}
                return 0
        except OSError:
            return 0
        found = connections(self.port)
        self.seen = {inode: self.seen.get(inode, now) for inode in found}
        by_peer: dict[str, list[int]] = {}
        for inode, peer in found.items():
            by_peer.setdefault(peer, []).append(inode)
        past: set[int] = set()
        for peer, inodes in by_peer.items():
            if len(inodes) > self.per_peer:
                inodes.sort(key=self.seen.__getitem__)
                past.update(inodes[self.per_peer :])
                log.info(
                    "gRPC: %d connections from %s past grpc_peer_connections closed", len(inodes) - self.per_peer, peer
                )
        if past:
            _shut(past)
        return len(past)

    async def run(self) -> None:
        """Look every :data:`CHECK_EVERY` seconds until cancelled (off the event loop)."""
        if not all(table.exists() for table in TABLES):
            return
        while True:
            await asyncio.to_thread(self.check)
            await asyncio.sleep(CHECK_EVERY)
