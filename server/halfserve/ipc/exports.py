"""Memory of the engine process that instance processes may map too: the HTTP front-ends' slots.

A request decoded by a front-end lies in the front-end's ``memfd`` slot, which the engine process maps
(:mod:`halfserve.multiproc.engine_side`). Exported here, a batch's chunks that lie in such memory are not copied for
an instance process: the batch's frame names the region and the offset, the process is handed the region's
descriptor once on a side channel (:func:`hand`), maps it (page-locked on CUDA, so the rows go from the front-end's
slot straight to the device) and reads the rows where they are, as an instance thread does
(:class:`ImportedRegions`).
"""

from __future__ import annotations

import contextlib
import itertools
import mmap
import os
import socket
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

HANDOVER = struct.Struct("<QQ")
"""The side channel's message handing over a region's descriptor: its id and size."""

Pin = Callable[[mmap.mmap], Callable[[], None] | None]
"""Page-locks a map for the device; returns the function that unpins it, or None when it could not."""


@dataclass(frozen=True)
class ExportedRegion:
    """Memory exported to instance processes: its id, a descriptor to hand them, where it is mapped here."""

    id: int
    fd: int
    start: int
    size: int


_regions: dict[int, ExportedRegion] = {}
_forgotten: list[Callable[[int], None]] = []
_ids = itertools.count(1)
_lock = threading.Lock()


def export(memory: mmap.mmap, fd: int) -> Callable[[], None]:
    """Export ``memory`` (mapped from ``fd``, which stays the caller's) to instance processes; returns the function
    that withdraws it, to call once no request in it can still be running."""
    view = np.frombuffer(memory, np.uint8)
    start = view.ctypes.data
    del view  # the map can close once withdrawn
    with _lock:
        region = ExportedRegion(next(_ids), os.dup(fd), start, len(memory))
        _regions[region.id] = region

    def withdraw() -> None:
        with _lock:
            gone = _regions.pop(region.id, None)
            listeners = list(_forgotten)
        if gone is not None:
            for forget in listeners:
                forget(gone.id)
            os.close(gone.fd)

    return withdraw


def locate(chunk: np.ndarray) -> tuple[ExportedRegion, int] | None:
    """The region a chunk lies in wholly, and its offset there; None when it lies in none (or is not contiguous).
    Pure Python, a loop over a handful of regions: asked for every chunk of every batch."""
    if not _regions or not chunk.flags.c_contiguous:
        return None
    start = chunk.__array_interface__["data"][0]
    end = start + chunk.nbytes
    for region in _regions.values():
        if region.start <= start and end <= region.start + region.size:
            return region, start - region.start
    return None


def on_withdraw(forget: Callable[[int], None]) -> Callable[[], None]:
    """Call ``forget(region id)`` whenever a region is withdrawn; returns the function that stops it."""
    with _lock:
        _forgotten.append(forget)

    def stop() -> None:
        with _lock:
            if forget in _forgotten:
                _forgotten.remove(forget)

    return stop


def hand(side: socket.socket, region: ExportedRegion) -> None:
    """Send ``region``'s descriptor on an instance process's side channel (before the frame that names it)."""
    socket.send_fds(side, [HANDOVER.pack(region.id, region.size)], [region.fd])


class ImportedRegions:
    """An instance process's end: the exported regions it was handed, mapped and (with ``pin``) page-locked once
    each."""

    def __init__(self, side: socket.socket, pin: Pin | None) -> None:
        self.side, self.pin = side, pin
        self.maps: dict[int, tuple[mmap.mmap, Callable[[], None] | None]] = {}

    def get(self, region: int) -> mmap.mmap:
        """A region's map; its descriptor was sent on the side channel before the frame that names it."""
        while region not in self.maps:
            data, fds, _, _ = socket.recv_fds(self.side, HANDOVER.size, 1)
            if not fds:
                raise ConnectionError("the side channel closed")
            rid, size = HANDOVER.unpack(data)
            try:
                memory = mmap.mmap(fds[0], size)
            finally:
                os.close(fds[0])
            self.maps[rid] = (memory, self.pin(memory) if self.pin is not None else None)
        return self.maps[region][0]

    def forget(self, region: int) -> None:
        found = self.maps.pop(region, None)
        if found is not None:
            memory, unpin = found
            if unpin is not None:
                unpin()
            with contextlib.suppress(BufferError):  # a view still held: the map goes with it
                memory.close()
