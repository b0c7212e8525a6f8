"""Both ends' half of the instance-process protocol: what the process is told at start, the frames, the memory.

Frames are :mod:`halfserve.multiproc.wire`'s (``<II`` lengths, an orjson header, a payload). The server process sends

* ``{"op": "run", "id", "dtype", "shape", "chunks", "raw"}``: a batch of rows of ``dtype`` (a numpy descriptor,
  :func:`descr`) and per-row ``shape``, as chunks ``[where, offset, rows]``, one per request: ``where`` is
  :data:`INPUT_REGION` (the instance's own input region), :data:`IN_FRAME` (the payload, one after another) or the
  id of a shared region (:mod:`halfserve.isolated.shared`) whose descriptor went before, on the side channel. ``raw``
  asks for the model's outputs without the overflow policy (the fidelity check's forward);
* ``{"op": "forget", "region"}``: unmap a shared region (no batch in it runs);
* ``{"op": "exit"}``: finish the batch in hand and exit.

The instance process sends ``{"op": "ready", "info", "warmup_seconds", "pid"}`` once warm (or ``{"op": "failed",
"error"}`` and exits), then per batch ``{"id", "outcomes", "counts"}``, where each outcome is ``["out", dtype, shape,
offset, precision]`` (rows at ``offset`` in the output region, or in the payload when ``inline``) or ``["error",
kind, message]``; or ``{"id", "raise", "kind", "message"}`` when the batch as a whole failed.
"""

from __future__ import annotations

import functools
import math
import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from halfserve import packing
from halfserve.isolated.handover import Code
from halfserve.manifest import Manifest
from halfserve.settings import Settings

INPUT_REGION, IN_FRAME = 0, -1
"""Where a chunk lies, besides a shared region's id (from 1): the instance's own input region, or the frame."""
REGION = struct.Struct("<QQ")
"""The side channel's message handing over a region's descriptor: its id and size."""
INPUT_SLACK = 4096
"""Bytes added to a region's computed size: records align their fields, and a page costs nothing until touched."""
MAX_REGION_BYTES = 1 << 30
"""Largest region allocated for one instance's inputs or outputs; a batch that does not fit travels in the frame."""


@dataclass(frozen=True)
class ChildConfig:
    """What an instance process is told when it is spawned (pickled by multiprocessing, never read from disk)."""

    settings: Settings
    manifest: Manifest
    """The manifest as the server process serves it (not read again from the store)."""
    version: int
    registers: str | None
    """The module to import for the manifest's architecture to be registered, as it was in the server process by
    code it imported (:func:`halfserve.models.registered_in`)."""
    precision: str
    max_batch_size: int
    index: int
    cores: int
    """Intra-op threads this process starts with and settles over: the server's cores, or ``settings.threads``."""
    fixed_shapes: bool
    """Whether every model served pads to buckets (cuDNN's autotuning is on then, as in the server process)."""
    input_bytes: int
    output_bytes: int
    code: Code | None = None
    """The ``--code-path`` module the architecture comes from, as the server process read it at load."""
    hf_config: dict[str, Any] | None = None
    """A Hugging Face model's configuration as the server process loaded it (its config.json is not read again)."""


def region_sizes(manifest: Manifest, max_batch_size: int) -> tuple[int, int]:
    """Bytes of the shared input and output regions for a full batch of ``manifest``'s model."""
    if packing.packs_records(manifest):
        row_in = packing.input_records(manifest).itemsize
        row_out = packing.output_records(manifest).itemsize
    else:
        spec, out = manifest.inputs[0], manifest.outputs[0]
        row_in = math.prod(spec.bounded()) * spec.datatype.numpy.itemsize
        # Floating outputs come back as float32 (fp16 widened; float64 is never served).
        row_out = math.prod(out.bounded()) * max(out.datatype.numpy.itemsize, 4)
    sizes = (max_batch_size * row_in + INPUT_SLACK, max_batch_size * row_out + INPUT_SLACK)
    return min(sizes[0], MAX_REGION_BYTES), min(sizes[1], MAX_REGION_BYTES)


class Memory:
    """An instance's shared memory: its input region, then its output region (one ``memfd``, mapped by both ends)."""

    def __init__(self, fd: int, input_bytes: int, output_bytes: int) -> None:
        self.input_bytes, self.output_bytes = input_bytes, output_bytes
        self.map = mmap.mmap(fd, input_bytes + output_bytes)
        os.close(fd)

    @staticmethod
    def create(name: str, input_bytes: int, output_bytes: int) -> tuple[Memory, int]:
        """A new memfd of the regions' size, mapped here; returns it and a duplicate of its fd to hand the other end."""
        fd = os.memfd_create(name)
        os.ftruncate(fd, input_bytes + output_bytes)
        other = os.dup(fd)
        return Memory(fd, input_bytes, output_bytes), other

    def inputs(self, dtype: np.dtype[Any], rows: int, shape: tuple[int, ...], offset: int = 0) -> np.ndarray:
        """A view of ``rows`` rows at ``offset`` bytes into the input region (they fit: the caller checked)."""
        return np.frombuffer(self.map, dtype, rows * math.prod(shape), offset).reshape(rows, *shape)

    def output(self, dtype: np.dtype[Any], shape: tuple[int, ...], offset: int) -> np.ndarray | None:
        """A view of an array at ``offset`` bytes into the output region, or None when it does not fit."""
        count = math.prod(shape)
        if offset + count * dtype.itemsize > self.output_bytes:
            return None
        return np.frombuffer(self.map, dtype, count, self.input_bytes + offset).reshape(shape)

    def close(self) -> None:
        self.map.close()


@functools.lru_cache(maxsize=64)
def descr(dtype: np.dtype[Any]) -> Any:
    """A JSON-able description of ``dtype`` (records included), which :func:`dtype_of` reads back."""
    return np.lib.format.dtype_to_descr(dtype)


def dtype_of(description: Any) -> np.dtype[Any]:
    """The dtype :func:`descr` described, after a JSON round trip (which turned its tuples into lists)."""
    return np.lib.format.descr_to_dtype(_tuples(description))


def _tuples(description: Any) -> Any:
    if isinstance(description, str):
        return description
    return [
        (f[0], _tuples(f[1]), tuple(f[2])) if len(f) > 2 else (f[0], _tuples(f[1]))  # name, type[, shape]
        for f in description
    ]
