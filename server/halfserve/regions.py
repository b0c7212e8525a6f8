"""Registered system shared memory regions: a client's POSIX shared memory, read and written by the server.

The object is the client's, and it may shrink it, or fill the tmpfs it lives on, at any moment. A mapping would turn
either into SIGBUS on the next access, which kills the process however it is guarded: a size check before the access
always leaves a window. So the server never maps a client's object: it reads with ``preadv`` into a buffer of its own
and writes with ``pwrite``, and a shrunk object is a short read (:class:`~halfserve.serving.RegionError`), a full tmpfs
``ENOSPC`` (:class:`~halfserve.serving.RegionFullError`). The routes that register regions and name them in requests are
:mod:`halfserve.api.http.shm`.
"""

from __future__ import annotations

import errno
import os
import re
import stat
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from halfserve.serving import RegionError, RegionFullError

SHM_DIR = Path("/dev/shm")
_KEY = re.compile(r"/[^/\x00]{1,254}")


@dataclass(frozen=True)
class Region:
    """A registered region: ``byte_size`` bytes from ``offset`` into the shared memory object ``key``."""

    name: str
    key: str
    offset: int
    byte_size: int
    fd: int
    """Every read and write goes through it (closed when the region is dropped)."""

    def status(self) -> dict[str, Any]:
        return {"name": self.name, "key": self.key, "offset": self.offset, "byte_size": self.byte_size}

    def check(self, offset: int, size: int, field: str) -> None:
        """A 400 naming ``field`` when ``size`` bytes from ``offset`` fall outside the region."""
        if offset + size > self.byte_size:
            raise RegionError(
                f"{field}: {size} bytes from offset {offset} overrun shared memory region {self.name!r} "
                f"({self.byte_size} bytes)",
            )

    def read(self, offset: int, size: int, field: str) -> bytearray:
        """A copy of ``size`` bytes from ``offset`` into the region, or a 400 naming ``field`` when they fall outside
        it or past the end of the object as it is now."""
        self.check(offset, size, field)
        buf = bytearray(size)
        got = os.preadv(self.fd, [buf], self.offset + offset)
        if got != size:
            raise RegionError(f"{field}: the shared memory object of region {self.name!r} shrank below it")
        return buf

    def write(self, offset: int, data: memoryview, field: str) -> None:
        """``data`` written from ``offset`` into the region; a 400 when the object shrank below it, a 507 when the
        file system holding the object has no room for its pages."""
        self.check(offset, len(data), field)
        start = self.offset + offset
        # Not grown back: an object its owner shrank is the owner's decision (a shrink after this check is not
        # harmful either: pwrite extends the file, where a mapping would fault).
        if os.fstat(self.fd).st_size < start + len(data):
            raise RegionError(f"{field}: the shared memory object of region {self.name!r} shrank below it")
        try:
            written = os.pwrite(self.fd, data, start)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                raise RegionFullError(
                    f"{field}: no room to write shared memory region {self.name!r}: {e.strerror}"
                ) from None
            raise RegionError(f"{field}: cannot write shared memory region {self.name!r}: {e.strerror}") from None
        if written != len(data):
            raise RegionFullError(
                f"{field}: only {written} of {len(data)} bytes fit shared memory region {self.name!r}"
            )


def open_region(name: str, key: str, offset: int, byte_size: int) -> Region:
    """Map ``key`` and check that it holds ``byte_size`` bytes from ``offset``; a 400 naming the problem if not."""
    if not _KEY.fullmatch(key):
        raise RegionError(f"key: expected a POSIX shared memory name such as '/input0', got {key!r}")
    path = SHM_DIR / key[1:]
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise RegionError(f"key: cannot open shared memory {key!r}: {e.strerror}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise RegionError(f"key: {key!r} is not a shared memory object")
        if offset + byte_size > info.st_size or byte_size == 0:
            raise RegionError(
                f"byte_size: {byte_size} bytes from offset {offset} do not fit {key!r} ({info.st_size} bytes)"
            )
    except BaseException:
        os.close(fd)
        raise
    region = Region(name, key, offset, byte_size, fd)
    weakref.finalize(region, os.close, fd)
    return region


class Regions:
    """The registered regions, by name. Unregistering drops a region from the table; its descriptor is closed once
    no request still reads or writes it."""

    def __init__(self) -> None:
        self.regions: dict[str, Region] = {}
        self.generation = 0
        """Counts changes, so that the engine process knows when to tell its front-ends."""

    def register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        """Open ``byte_size`` bytes from ``offset`` into the shared memory object ``key`` as region ``name``."""
        if name in self.regions:
            raise RegionError(f"shared memory region {name!r} is already registered; unregister it first")
        self.regions[name] = open_region(name, key, offset, byte_size)
        self.generation += 1

    def unregister(self, name: str | None) -> None:
        """Drop ``name`` (every region when None); a name not registered is not an error, as in Triton."""
        if name is None:
            self.regions.clear()
        else:
            self.regions.pop(name, None)
        self.generation += 1

    def status(self) -> list[dict[str, Any]]:
        return [r.status() for r in self.regions.values()]

    def get(self, name: object, field: str) -> Region:
        region = self.regions.get(name) if isinstance(name, str) else None
        if region is None:
            raise RegionError(f"{field}: no shared memory region {name!r} is registered")
        return region

    def sync(self, listing: list[dict[str, Any]]) -> None:
        """Mirror the engine process's regions (a front-end's copy): open the new ones, drop the gone ones."""
        fresh: dict[str, Region] = {}
        for entry in listing:
            old = self.regions.get(entry["name"])
            if old is not None and old.status() == entry:
                fresh[old.name] = old
                continue
            try:
                fresh[entry["name"]] = open_region(entry["name"], entry["key"], entry["offset"], entry["byte_size"])
            except RegionError:
                continue  # gone since the engine process mapped it: requests naming it fail as unregistered
        self.regions = fresh
