"""Memory of the engine process that instance processes may map too: the HTTP front-ends' slots.

A request decoded by a front-end lies in the front-end's ``memfd`` slot, which the engine process maps
(:mod:`halfserve.multiproc.engine_side`). Registered here, a batch's chunks that lie in such memory are not copied for
an instance process: the batch's frame names the region and the offset, the process maps the region once (page-locked
on CUDA, so the rows go from the front-end's slot straight to the device) and reads the rows where they are, as an
instance thread does.
"""

from __future__ import annotations

import itertools
import mmap
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Region:
    """Shared memory registered for instance processes: its id, a descriptor to hand them, where it is mapped here."""

    id: int
    fd: int
    start: int
    size: int


_regions: dict[int, Region] = {}
_forgotten: list[Callable[[int], None]] = []
_ids = itertools.count(1)
_lock = threading.Lock()


def share(memory: mmap.mmap, fd: int) -> Callable[[], None]:
    """Register ``memory`` (mapped from ``fd``, which stays the caller's) for instance processes; returns the function
    that withdraws it, to call once no request in it can still be running."""
    view = np.frombuffer(memory, np.uint8)
    start = view.ctypes.data
    del view  # the map can close once withdrawn
    with _lock:
        region = Region(next(_ids), os.dup(fd), start, len(memory))
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


def locate(chunk: np.ndarray) -> tuple[Region, int] | None:
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
