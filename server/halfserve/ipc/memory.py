"""Shared memory two processes map: a front-end's slots, an instance process's input and output regions.

Each is one ``memfd`` (no ``/dev/shm`` space, no file left behind), created by one end and handed to the other over
a Unix socket (``SCM_RIGHTS``); both map it. A frame then says where in it the tensors lie.
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from halfserve.ipc.tensors import TensorList
from halfserve.serving import Tensors


@dataclass
class Slots:
    """A front-end's shared memory, cut into slots of ``slot_bytes``; mapped by it and by the engine process."""

    memory: mmap.mmap
    slot_bytes: int

    @staticmethod
    def create(name: str, slots: int, slot_bytes: int) -> tuple[Slots, int]:
        """A new memfd of ``slots`` slots, mapped here; returns it and the memfd, the caller's to hand over and close.
        Memory is committed only for the slots used."""
        fd = os.memfd_create(name)
        os.ftruncate(fd, slots * slot_bytes)
        return Slots(mmap.mmap(fd, slots * slot_bytes), slot_bytes), fd

    def view(self, slot: int, dtype: np.dtype[Any], shape: list[int] | tuple[int, ...], offset: int = 0) -> np.ndarray:
        """The array of ``dtype`` and ``shape`` at ``offset`` bytes into ``slot``."""
        count = math.prod(shape)  # numpy.prod costs ~10 us of Python per call, here twice per request
        return np.frombuffer(self.memory, dtype, count, slot * self.slot_bytes + offset).reshape(shape)

    def put(self, slot: int, tensors: Tensors) -> TensorList:
        """Copy ``tensors`` into ``slot`` (they fit: see :func:`halfserve.ipc.tensors.nbytes`); their places, for the
        header."""
        places, offset = [], 0
        for name, a in tensors.items():
            np.copyto(self.view(slot, a.dtype, a.shape, offset), a)
            places.append([name, a.dtype.str, a.shape, offset])
            offset += a.nbytes
        return places

    def take(self, slot: int, places: TensorList) -> dict[str, np.ndarray]:
        """The tensors at ``places`` in ``slot``, as views of the shared memory (copy them to keep them)."""
        return {name: self.view(slot, np.dtype(dtype), shape, offset) for name, dtype, shape, offset in places}


_TAKEN = struct.Struct("<q")


class InstanceMemory:
    """An instance's shared memory: its input region, then its output region, then the id of the last op the instance
    took (one ``memfd``, mapped by both ends)."""

    def __init__(self, fd: int, input_bytes: int, output_bytes: int) -> None:
        self.input_bytes, self.output_bytes = input_bytes, output_bytes
        self.map = mmap.mmap(fd, input_bytes + output_bytes + _TAKEN.size)
        os.close(fd)

    @staticmethod
    def create(name: str, input_bytes: int, output_bytes: int) -> tuple[InstanceMemory, int]:
        """A new memfd of the regions' size, mapped here; returns it and a duplicate of its fd to hand the other end."""
        fd = os.memfd_create(name)
        os.ftruncate(fd, input_bytes + output_bytes + _TAKEN.size)
        other = os.dup(fd)
        return InstanceMemory(fd, input_bytes, output_bytes), other

    def inputs(self, dtype: np.dtype[Any], rows: int, shape: tuple[int, ...], offset: int = 0) -> np.ndarray:
        """A view of ``rows`` rows at ``offset`` bytes into the input region (they fit: the caller checked)."""
        return np.frombuffer(self.map, dtype, rows * math.prod(shape), offset).reshape(rows, *shape)

    def output(self, dtype: np.dtype[Any], shape: tuple[int, ...], offset: int) -> np.ndarray | None:
        """A view of an array at ``offset`` bytes into the output region, or None when it does not fit."""
        count = math.prod(shape)
        if offset + count * dtype.itemsize > self.output_bytes:
            return None
        return np.frombuffer(self.map, dtype, count, self.input_bytes + offset).reshape(shape)

    def took(self, op: int) -> None:
        """The instance took op ``op`` off its socket and runs it (ids rise; 0, the memfd's zeros: none yet)."""
        _TAKEN.pack_into(self.map, self.input_bytes + self.output_bytes, op)

    @property
    def taken(self) -> int:
        """The id of the last op the instance took. Read once its process is gone, it tells an op it never reached
        (no request's fault) from one it died running: a store to shared memory, where an acknowledgement frame
        would cost a send and a read per batch."""
        (op,) = _TAKEN.unpack_from(self.map, self.input_bytes + self.output_bytes)
        return int(op)

    def close(self) -> None:
        self.map.close()
