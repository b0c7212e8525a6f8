"""The backplane's wire: frames on a Unix socket, shared-memory slots, named tensors in either.

A frame is ``<II`` (header length, payload length), an orjson header, then the payload. Tensors travel as a list of
``[name, dtype, shape, offset]`` in the header and their bytes one after another, from ``offset``, in the request's
shared-memory slot or, when they do not fit one, in the payload.
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson

from halfserve.serving import Tensors

FRAME = struct.Struct("<II")
"""A frame's prefix: header length, payload length (bytes)."""
SLOTS = 128
"""Shared-memory slots per front-end: as many of its requests as can be in flight without inline copies."""
SLOT_BYTES = 2 * 2**20
"""Bytes per slot, enough for a 224x224 RGB image in fp32 (602 KB) with room to spare; memory is committed only
for the slots a front-end has used."""
HELLO_BYTES = 4096
HELLO_TIMEOUT_S = 5.0
"""How long a new connection has to send its hello before it is dropped."""

TensorList = list[list[Any]]
"""Named tensors' places in a header: ``[name, dtype, shape, offset]`` each."""


def frame(header: dict[str, Any], *payload: bytes | memoryview) -> list[bytes | memoryview]:
    """The buffers of one frame, for ``transport.writelines``; the payload may come in parts."""
    head = orjson.dumps(header)
    parts: list[bytes | memoryview] = [FRAME.pack(len(head), sum(len(p) for p in payload)), head]
    parts.extend(p for p in payload if len(p))
    return parts


class FrameReader:
    """Cuts a byte stream into (header, payload) frames."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[tuple[dict[str, Any], bytearray]]:
        self._buf += data
        out: list[tuple[dict[str, Any], bytearray]] = []
        buf, pos = self._buf, 0
        while len(buf) - pos >= FRAME.size:
            head_len, payload_len = FRAME.unpack_from(buf, pos)
            end = pos + FRAME.size + head_len + payload_len
            if len(buf) < end:
                break
            start = pos + FRAME.size
            header = orjson.loads(memoryview(buf)[start : start + head_len])
            out.append((header, buf[start + head_len : end]))
            pos = end
        if pos:
            del buf[:pos]
        return out


@dataclass
class Segment:
    """A front-end's shared memory, cut into slots of ``slot_bytes``; mapped by it and by the engine process."""

    memory: mmap.mmap
    slot_bytes: int

    def view(self, slot: int, dtype: np.dtype[Any], shape: list[int] | tuple[int, ...], offset: int = 0) -> np.ndarray:
        """The array of ``dtype`` and ``shape`` at ``offset`` bytes into ``slot``."""
        count = math.prod(shape)  # numpy.prod costs ~10 us of Python per call, here twice per request
        return np.frombuffer(self.memory, dtype, count, slot * self.slot_bytes + offset).reshape(shape)

    def put(self, slot: int, tensors: Tensors) -> TensorList:
        """Copy ``tensors`` into ``slot`` (they fit: see :func:`nbytes`); their places, for the header."""
        places, offset = [], 0
        for name, a in tensors.items():
            np.copyto(self.view(slot, a.dtype, a.shape, offset), a)
            places.append([name, a.dtype.str, a.shape, offset])
            offset += a.nbytes
        return places

    def take(self, slot: int, places: TensorList) -> dict[str, np.ndarray]:
        """The tensors at ``places`` in ``slot``, as views of the shared memory (copy them to keep them)."""
        return {name: self.view(slot, np.dtype(dtype), shape, offset) for name, dtype, shape, offset in places}


def nbytes(tensors: Tensors) -> int:
    """Bytes the tensors take one after another."""
    if len(tensors) == 1:  # the common case, on every request
        return next(iter(tensors.values())).nbytes
    return sum(a.nbytes for a in tensors.values())


def inline(tensors: Tensors) -> tuple[TensorList, list[memoryview]]:
    """``tensors`` as a frame's payload: their places in it, and its parts (the arrays' own bytes, not copied)."""
    places, parts, offset = [], [], 0
    for name, a in tensors.items():
        places.append([name, a.dtype.str, a.shape, offset])
        parts.append(np.ascontiguousarray(a).data.cast("B"))
        offset += a.nbytes
    return places, parts


def from_payload(payload: bytearray, places: TensorList) -> dict[str, np.ndarray]:
    """The tensors at ``places`` in a frame's payload (arrays over it, not copies)."""
    out = {}
    for name, dtype, shape, offset in places:
        dt = np.dtype(dtype)
        out[name] = np.frombuffer(payload, dt, math.prod(shape), offset).reshape(shape)
    return out
