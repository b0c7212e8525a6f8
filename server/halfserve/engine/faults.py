"""The two faults of a forward that the engine recognises, because they need torch to see:

* Out of memory (:func:`is_out_of_memory`): the forward raises :class:`~halfserve.errors.BatchTooLargeError`
  instead, and the batcher (which owns chunks and batch sizes) halves its batch size and reruns the rows in smaller
  batches.
* Overflow (:class:`OverflowGuard`): a half-precision forward whose output is not finite where the input was (fp16
  tops out at 65504) is handled per the model's :class:`~halfserve.manifest.OverflowPolicy`: rerun in fp32 on the host
  copy of the weights (tagged ``fp32``), fail that chunk, or pass the non-finite values through.
"""

from __future__ import annotations

import threading

import numpy as np
import torch
from torch import nn

from halfserve import packing, records
from halfserve import precision as prec
from halfserve.engine.inputs import Normalizer
from halfserve.engine.protocol import EngineError, PrecisionOverflowError
from halfserve.engine.rows import all_finite, checked, row_slices, rows_finite
from halfserve.manifest import OverflowPolicy, Precision
from halfserve.serving import Outcome, Output
from halfserve.store import LoadedModel

HOST = torch.device("cpu")


def is_out_of_memory(e: BaseException) -> bool:
    """True for torch's out-of-memory error (CUDA and other accelerators), and the CPU allocator's failure, which
    torch raises as a plain RuntimeError."""
    if isinstance(e, torch.OutOfMemoryError):
        return True
    return isinstance(e, RuntimeError) and "DefaultCPUAllocator: can't allocate memory" in str(e)


class OverflowGuard:
    """A model's overflow policy over the output rows of its forwards at ``precision``, with the overflows and fp32
    reruns it counted. Its reruns run ``loaded``'s host module, the fp32 weights, kept only where the policy reruns."""

    def __init__(self, loaded: LoadedModel, policy: OverflowPolicy, precision: Precision, positional: bool) -> None:
        manifest = loaded.manifest
        self.policy, self.precision, self.manifest = policy, precision, manifest
        self.guarded = precision is not Precision.FP32
        """Whether outputs are checked for overflow: only a reduced precision can overflow where fp32 would not."""
        # The host's fp32 weights are kept only where they can be needed: reruns of overflowing half outputs.
        self.fp32: nn.Module | None = loaded.module if self.guarded and policy is OverflowPolicy.RERUN_FP32 else None
        norm = manifest.normalize
        self._normalize = Normalizer(norm, len(manifest.inputs[0].shape), HOST) if norm else None
        self._named, self._positional = packing.packs_records(manifest), positional
        self._output_records = packing.output_records(manifest)
        self._output_names = [t.name for t in manifest.outputs]
        self._lock = threading.Lock()
        self.overflows = 0
        """Chunks whose half-precision output was not finite for a finite input, whatever the policy did."""
        self.fp32_reruns = 0
        """Chunks rerun in fp32 because of such an overflow."""

    def outcomes(self, chunks: list[np.ndarray], out: np.ndarray) -> list[Outcome]:
        """One outcome per chunk of a batch's output rows, after the overflow policy."""
        outs = row_slices(out, chunks)
        tag = self.precision
        # One vectorised check over the whole batch: the per-chunk work below only runs when something is wrong.
        if self.guarded and not all_finite(out):
            return [self._guard(c, o) for c, o in zip(chunks, outs, strict=True)]
        return [Output(o, tag) for o in outs]

    def _guard(self, x: np.ndarray, out: np.ndarray) -> Outcome:
        """Apply the overflow policy to one chunk's half-precision output."""
        tag = self.precision
        overflowed = rows_finite(x) & ~rows_finite(out)
        if not overflowed.any():  # non-finite in, non-finite out: the input's doing, not the precision's
            return Output(out, tag)
        with self._lock:  # instances run on their own threads
            self.overflows += 1
        if self.policy is OverflowPolicy.ALLOW:
            return Output(out, tag)
        rows = np.flatnonzero(overflowed).tolist()
        if self.policy is OverflowPolicy.ERROR:
            return PrecisionOverflowError(
                f"{tag} overflow: the output of row(s) {rows[:8]} is not finite for finite input "
                f"(the model's overflow policy is 'error'; 'rerun_fp32' would rerun them in fp32)"
            )
        with self._lock:
            self.fp32_reruns += 1
        return Output(self._rerun_fp32(x), Precision.FP32)

    def _rerun_fp32(self, x: np.ndarray) -> np.ndarray:
        """Run rows through the host's fp32 weights (the overflow fallback); returns float32 outputs."""
        if self.fp32 is None:
            raise EngineError("no fp32 weights are kept for reruns (the overflow policy is not rerun_fp32)")
        if self._named:
            with torch.inference_mode():
                outs, _ = records.run(self.manifest, self.fp32, x, len(x), HOST, Precision.FP32, self._positional)
            return records.to_host(outs, len(x), self._output_records)
        t = torch.from_numpy(x)
        if self._normalize is not None:
            t = self._normalize(t)
        t = prec.cast_input(t, Precision.FP32)
        with torch.inference_mode():
            y = records.first_output(self.fp32(t), self._output_names)
        return checked(y, len(x)).float().numpy()
