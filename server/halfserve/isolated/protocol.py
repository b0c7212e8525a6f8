"""The instance-process protocol, both ends' half: what the process is told at start, the frames' meaning, the
sizes of its memory.

Frames, shared memory and dtypes on the wire are :mod:`halfserve.ipc`'s: the frames :mod:`halfserve.ipc.frames`'s
(``<II`` lengths, an orjson header, a payload), the instance's input and output regions one
:class:`~halfserve.ipc.memory.InstanceMemory`. The server process sends

* ``{"op": "run", "id", "dtype", "shape", "chunks", "raw"}``: a batch of rows of ``dtype`` (a numpy descriptor,
  :func:`halfserve.ipc.tensors.descr`) and per-row ``shape``, as chunks ``[where, offset, rows]``, one per request:
  ``where`` is :data:`INPUT_REGION` (the instance's own input region), :data:`IN_FRAME` (the payload, one after
  another) or the id of an exported region (:mod:`halfserve.ipc.exports`) whose descriptor went before, on the side
  channel. ``raw`` asks for the model's outputs without the overflow policy (the fidelity check's forward);
* ``{"op": "handle", "id", "payloads"}``: a batch of raw payloads for the model's handler
  (:mod:`halfserve.isolated.handling`), each ``[field, content_type, size]``, their bytes one after another in the
  payload;
* ``{"op": "forget", "region"}``: unmap an exported region (no batch in it runs);
* ``{"op": "exit"}``: finish the batch in hand and exit.

The instance process sends ``{"op": "ready", "info", "warmup_seconds", "pid"}`` once warm (or ``{"op": "failed",
"error"}`` and exits), then per batch ``{"id", "outcomes", "region_bytes", "counts"}``, where each outcome is ``["out",
dtype, shape, offset, precision]`` (rows at ``offset`` in the output region, or in the payload when ``inline``) or
``["error", kind, message]``, and ``region_bytes`` is how much of the output region they use (copied out at once);
or ``{"id", "raise", "kind", "message"}`` when the batch as a whole failed. A handler batch's answer is a batch's
(its outputs' outcomes, one per forward) with ``"answers": [offset, sizes]``: each payload's JSON answer, one after
another in the payload from ``offset`` (past the outputs placed there); one that failed is ``raise`` with the kind of
:class:`~halfserve.serving` error the handler threads would have raised.

Before it runs a batch or a handler batch, the instance process writes its id past its output region
(:meth:`~halfserve.ipc.memory.InstanceMemory.took`): once the process is gone, an op with a later id never reached it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from halfserve import packing
from halfserve.isolated.handover import Code
from halfserve.manifest import Manifest
from halfserve.settings import Settings

INPUT_REGION, IN_FRAME = 0, -1
"""Where a chunk lies, besides an exported region's id (from 1): the instance's own input region, or the frame."""
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
    fp32_modules: tuple[str, ...] = ()
    """The modules a mixed-precision plan keeps in fp32 (:mod:`halfserve.mixed`)."""


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
