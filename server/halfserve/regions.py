"""Registered system shared memory regions: a client's POSIX shared memory, read and written by the server.

The object is the client's, and it may shrink it, or fill the tmpfs it lives on, at any moment. A mapping would turn
either into SIGBUS on the next access, which kills the process however it is guarded: a size check before the access
always leaves a window. So the server never maps a client's object: it reads with ``preadv`` into a buffer of its own
and writes with ``pwrite``, and a shrunk object is a short read (:class:`~halfserve.errors.RegionError`), a full tmpfs
``ENOSPC`` (:class:`~halfserve.errors.RegionFullError`). The routes that register regions and name them in requests are
:mod:`halfserve.api.http.shm`.

Each region keeps a descriptor open in the engine process and in each front-end, so their number is held to
``max_shm_regions`` (:class:`Regions`), and a name to :data:`MAX_REGION_NAME` printable characters: a descriptor table
filled by regions would leave none for new connections. A descriptor the server cannot get for a region (its open-file
limit reached all the same) is its own shortage, :class:`~halfserve.errors.ServerResourceError` (503), not the
client's mistake.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import stat
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from halfserve.errors import OverLimitError, RegionError, RegionFullError, ServerResourceError

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
_KEY = re.compile(r"/[^/\x00]{1,254}")
MAX_REGION_NAME = 128
"""Most characters of a region's name: tritonclient's and perf_analyzer's names are a tensor's name and a suffix, and
every name shows in the status listing."""
_NAME = re.compile(r"(?!\.\.?$)[!-.0-~]+")
"""Printable ASCII without spaces, so that a name quoted in a log line or a refusal cannot forge or hide anything;
without ``/`` and other than ``.`` and ``..``, so that it is one segment of the HTTP routes' paths (a region ``..`` was
unregistered by ``/v2/systemsharedmemory/region/../unregister``, which a client resolves to unregister every region)."""
_OUT_OF_DESCRIPTORS = (errno.EMFILE, errno.ENFILE)


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


def check_name(name: str) -> None:
    """A 400 when ``name`` is empty, longer than :data:`MAX_REGION_NAME`, or holds other than printable ASCII."""
    if not 0 < len(name) <= MAX_REGION_NAME:
        raise RegionError(f"shared memory region name: expected 1 to {MAX_REGION_NAME} characters, got {len(name)}")
    if not _NAME.fullmatch(name):
        raise RegionError(
            "shared memory region name: expected printable ASCII characters without spaces or '/', other than '.' "
            f"and '..' (one segment of a URL path), got {name!r}"
        )


def open_region(name: str, key: str, offset: int, byte_size: int) -> Region:
    """Open ``key`` and check that it holds ``byte_size`` bytes from ``offset``; a 400 naming the problem if not, a
    503 when the server has no descriptor to spare."""
    if not _KEY.fullmatch(key):
        raise RegionError(f"key: expected a POSIX shared memory name such as '/input0', got {key!r}")
    path = SHM_DIR / key[1:]
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        if e.errno in _OUT_OF_DESCRIPTORS:
            raise ServerResourceError(
                f"cannot open shared memory {key!r}: the server is out of file descriptors ({e.strerror}); "
                "its open-file limit is too low for its connections and max_shm_regions"
            ) from None
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
    """The registered regions, by name, at most ``most`` of them (``max_shm_regions``). Unregistering drops a region
    from the table; its descriptor is closed once no request still reads or writes it."""

    def __init__(self, most: int) -> None:
        self.most = most
        self.regions: dict[str, Region] = {}
        self.generation = 0
        """Counts changes, so that the engine process knows when to tell its front-ends."""
        self.unmirrored: dict[str, dict[str, Any]] = {}
        """A front-end's regions the engine process registered that it could not open for want of file descriptors:
        opened again when a request names one, and a 503 while that fails (not the client's "not registered")."""

    def register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        """Open ``byte_size`` bytes from ``offset`` into the shared memory object ``key`` as region ``name``."""
        check_name(name)
        if name in self.regions:
            raise RegionError(f"shared memory region {name!r} is already registered; unregister it first")
        if len(self.regions) >= self.most:
            raise OverLimitError(
                f"cannot register shared memory region {name!r}: {len(self.regions)} regions are registered, the "
                "limit (max_shm_regions); unregister one first"
            )
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
        if region is None and isinstance(name, str) and name in self.unmirrored:
            entry = self.unmirrored[name]
            try:  # raises ServerResourceError (503) while the descriptors are still short
                region = open_region(name, entry["key"], entry["offset"], entry["byte_size"])
            except RegionError:
                del self.unmirrored[name]  # gone since: as unregistered
            else:
                del self.unmirrored[name]
                self.regions[name] = region
        if region is None:
            raise RegionError(f"{field}: no shared memory region {name!r} is registered")
        return region

    def sync(self, listing: list[dict[str, Any]]) -> None:
        """Mirror the engine process's regions (a front-end's copy): open the new ones, drop the gone ones."""
        fresh: dict[str, Region] = {}
        self.unmirrored = {}
        for entry in listing:
            old = self.regions.get(entry["name"])
            if old is not None and old.status() == entry:
                fresh[old.name] = old
                continue
            try:
                fresh[entry["name"]] = open_region(entry["name"], entry["key"], entry["offset"], entry["byte_size"])
            except RegionError:
                continue  # gone since the engine process mapped it: requests naming it fail as unregistered
            except ServerResourceError as e:
                log.warning("shared memory region %r not mirrored in this process: %s", entry["name"], e)
                self.unmirrored[entry["name"]] = entry
        self.regions = fresh
