"""The engine: one model instance on one device, run in a dedicated thread under a precision policy.

Batches arrive as lists of numpy arrays (one per request chunk) and leave as one outcome per chunk: float32 output
rows tagged with the precision that computed them, or the error that fails that chunk alone. The thread keeps device
work off the event loop (torch releases the GIL during kernels), so the next batch forms while this one computes.

Two faults are the engine's to recognise, because they need torch to see:

* Out of memory: the forward raises :class:`~server.batching.BatchTooLargeError` instead, and the batcher (which
  owns chunks and batch sizes) halves its batch size and reruns the rows in smaller batches.
* Overflow: a half-precision forward whose output is not finite where the input was (fp16 tops out at 65504) is
  handled per the model's :class:`~server.store.OverflowPolicy`: rerun in fp32 on the host copy of the weights
  (tagged ``fp32``), fail that chunk, or pass the non-finite values through.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from server import precision as prec
from server.batching import BatchTooLargeError, Outcome, Output
from server.precision import Precision
from server.store import LoadedModel, OverflowPolicy

log = logging.getLogger(__name__)


class EngineError(RuntimeError):
    """The model's forward failed or returned something other than one output row per input row."""


class PrecisionOverflowError(EngineError):
    """A half-precision output was not finite for a finite input, and the model's overflow policy is ``error``."""


def is_out_of_memory(e: BaseException) -> bool:
    """True for torch's out-of-memory error (CUDA and other accelerators), and the CPU allocator's failure, which
    torch raises as a plain RuntimeError."""
    if isinstance(e, torch.OutOfMemoryError):
        return True
    return isinstance(e, RuntimeError) and "DefaultCPUAllocator: can't allocate memory" in str(e)


def _rows_finite(a: np.ndarray) -> np.ndarray:
    """Per row: True when every value of the row is finite (integers always are)."""
    if a.dtype.kind not in "fc":
        return np.ones(a.shape[0], dtype=bool)
    finite: np.ndarray = np.isfinite(a.reshape(a.shape[0], -1)).all(axis=1)
    return finite


@dataclass(frozen=True)
class EngineInfo:
    """What an engine serves, for listings and responses."""

    device: str
    precision: Precision
    weight_dtype: str
    weight_bytes: int
    fp32_fallback_bytes: int = 0
    """Host memory held by the fp32 copy kept for overflow reruns (0 when none is kept)."""


def batch_buckets(max_batch_size: int) -> list[int]:
    """Powers of two up to ``max_batch_size``, and ``max_batch_size`` itself: the batch sizes warmed up at load."""
    sizes = []
    b = 1
    while b < max_batch_size:
        sizes.append(b)
        b *= 2
    sizes.append(max_batch_size)
    return sizes


def resolve_device(name: str) -> torch.device:
    """``auto`` picks CUDA when present; anything else is passed to ``torch.device`` and checked."""
    if name == "auto":
        return prec.default_device()
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available")
    return device


class Engine:
    """Owns a model cast for serving on one device; runs batches in its own thread."""

    def __init__(
        self,
        loaded: LoadedModel,
        precision: Precision,
        device: torch.device,
        overflow: OverflowPolicy | None = None,
    ) -> None:
        self.name = loaded.manifest.name
        self.device = device
        self.precision = prec.resolve(precision, device)
        self.overflow = OverflowPolicy(overflow or loaded.manifest.overflow)
        spec = loaded.manifest.inputs[0]
        self.sample_shape = tuple(spec.shape)
        self.out_shape = tuple(loaded.manifest.outputs[0].shape)
        # The loaded module stays fp32 on the host; serving gets its own cast copy.
        self.model: nn.Module = prec.prepare_model(copy.deepcopy(loaded.module), self.precision, device)
        self.guarded = self.precision is not Precision.FP32
        """Whether outputs are checked for overflow: only a reduced precision can overflow where fp32 would not."""
        # The host's fp32 weights are kept only where they can be needed: reruns of overflowing half outputs.
        self._fp32: nn.Module | None = (
            loaded.module if self.guarded and self.overflow is OverflowPolicy.RERUN_FP32 else None
        )
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"engine-{self.name}")
        self.forwards = 0
        self.overflows = 0
        """Chunks whose half-precision output was not finite for a finite input, whatever the policy did."""
        self.fp32_reruns = 0
        """Chunks rerun in fp32 because of such an overflow."""

    @property
    def info(self) -> EngineInfo:
        return EngineInfo(
            device=str(self.device),
            precision=self.precision,
            weight_dtype=str(prec.weight_dtype(self.precision)).removeprefix("torch."),
            weight_bytes=module_bytes(self.model),
            fp32_fallback_bytes=module_bytes(self._fp32) if self._fp32 is not None else 0,
        )

    def forward(self, x: np.ndarray) -> np.ndarray:
        """Run one batch (rows first) synchronously; returns float32 outputs with one row per input row."""
        t = torch.from_numpy(x)
        if self.device.type == "cuda":
            t = t.pin_memory().to(self.device, non_blocking=True)
        t = prec.cast_input(t, self.precision)
        with prec.inference(self.precision, self.device):
            y = self.model(t)
        self.forwards += 1
        # float() on the device halves the copy for half outputs' consumers and gives JSON a stable dtype.
        return _checked(y, x).float().cpu().numpy()

    def forward_fp32(self, x: np.ndarray) -> np.ndarray:
        """Run rows through the host's fp32 weights (the overflow fallback); returns float32 outputs."""
        if self._fp32 is None:
            raise EngineError("no fp32 weights are kept for reruns (the overflow policy is not rerun_fp32)")
        t = prec.cast_input(torch.from_numpy(x), Precision.FP32)
        with torch.inference_mode():
            y = self._fp32(t)
        return _checked(y, x).float().numpy()

    def run_chunks(self, chunks: list[np.ndarray]) -> list[Outcome]:
        """Run the chunks of one batch as a single forward; returns one outcome per chunk.

        Raises :class:`~server.batching.BatchTooLargeError` when the device runs out of memory.
        """
        x = chunks[0] if len(chunks) == 1 else np.concatenate(chunks)
        try:
            out = self.forward(x)
        except Exception as e:
            if not is_out_of_memory(e):
                raise
            if self.device.type == "cuda":
                torch.cuda.empty_cache()  # give the failed batch's blocks back before the smaller reruns
            raise BatchTooLargeError(f"out of memory on {self.device} running {len(x)} rows: {e}") from None
        outs = [out] if len(chunks) == 1 else np.split(out, np.cumsum([len(c) for c in chunks])[:-1])
        tag = self.precision.value
        # One vectorised check over the whole batch: the per-chunk work below only runs when something is wrong.
        if self.guarded and not np.isfinite(out).all():
            return [self._guard(c, o) for c, o in zip(chunks, outs, strict=True)]
        return [Output(o, tag) for o in outs]

    def _guard(self, x: np.ndarray, out: np.ndarray) -> Outcome:
        """Apply the overflow policy to one chunk's half-precision output."""
        tag = self.precision.value
        overflowed = _rows_finite(x) & ~_rows_finite(out)
        if not overflowed.any():  # non-finite in, non-finite out: the input's doing, not the precision's
            return Output(out, tag)
        self.overflows += 1
        if self.overflow is OverflowPolicy.ALLOW:
            return Output(out, tag)
        rows = np.flatnonzero(overflowed).tolist()
        if self.overflow is OverflowPolicy.ERROR:
            return PrecisionOverflowError(
                f"{tag} overflow: the output of row(s) {rows[:8]} is not finite for finite input "
                f"(the model's overflow policy is 'error'; 'rerun_fp32' would rerun them in fp32)"
            )
        self.fp32_reruns += 1
        return Output(self.forward_fp32(x), Precision.FP32.value)

    async def run(self, chunks: list[np.ndarray]) -> list[Outcome]:
        """Run a batch on the engine's thread without blocking the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, self.run_chunks, chunks)

    def warmup(self, max_batch_size: int) -> float:
        """Run one forward per batch-size bucket so first requests pay no allocation or kernel-selection cost.

        Returns the seconds it took.
        """
        start = time.perf_counter()
        ref = next(iter(self.model.parameters()), None)
        for size in batch_buckets(max_batch_size):
            # new_zeros: the warm-up batch inherits the weights' device; inputs enter as fp32 like real requests.
            x = ref.new_zeros((size, *self.sample_shape), dtype=torch.float32) if ref is not None else None
            if x is None:
                x = torch.zeros((size, *self.sample_shape))
            self.forward(x.cpu().numpy())
        return time.perf_counter() - start

    def close(self) -> None:
        self._executor.shutdown(wait=True)


def module_bytes(module: nn.Module) -> int:
    """Bytes held by ``module``'s parameters and buffers, in their current dtype."""
    return sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))


def _checked(y: object, x: np.ndarray) -> torch.Tensor:
    if not isinstance(y, torch.Tensor):
        raise EngineError(f"model returned {type(y).__name__}, expected a tensor")
    if y.shape[0] != x.shape[0]:
        raise EngineError(f"batch size mismatch: model returned {y.shape[0]} rows for {x.shape[0]} inputs")
    return y
