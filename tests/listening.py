"""The TCP ports a process listens on, read from ``/proc`` (Linux): what a test of "nothing listens" checks."""

from __future__ import annotations

import os


def listening_ports(pid: int) -> set[int]:
    """The TCP ports process ``pid`` listens on, from ``/proc``: its sockets' inodes, found in the kernel's tables."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                    ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports
