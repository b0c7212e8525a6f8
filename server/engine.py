"""The engine: one model instance on one device, run in a dedicated thread under a precision policy.

Batches arrive as lists of numpy arrays (one per request chunk) and leave as a list of float32 numpy arrays, one per
chunk. The thread keeps device work off the event loop (torch releases the GIL during kernels), so the next batch
forms while this one computes.
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
from server.precision import Precision
from server.store import LoadedModel

log = logging.getLogger(__name__)


class EngineError(RuntimeError):
    """The model's forward failed or returned something other than one output row per input row."""


@dataclass(frozen=True)
class EngineInfo:
    """What an engine serves, for listings and responses."""

    device: str
    precision: Precision
    weight_dtype: str
    weight_bytes: int


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

    def __init__(self, loaded: LoadedModel, precision: Precision, device: torch.device) -> None:
        self.name = loaded.manifest.name
        self.device = device
        self.precision = prec.resolve(precision, device)
        spec = loaded.manifest.inputs[0]
        self.sample_shape = tuple(spec.shape)
        self.out_shape = tuple(loaded.manifest.outputs[0].shape)
        # The loaded module stays fp32 on the host; serving gets its own cast copy.
        self.model: nn.Module = prec.prepare_model(copy.deepcopy(loaded.module), self.precision, device)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"engine-{self.name}")
        self.forwards = 0

    @property
    def info(self) -> EngineInfo:
        params = list(self.model.parameters()) + list(self.model.buffers())
        return EngineInfo(
            device=str(self.device),
            precision=self.precision,
            weight_dtype=str(prec.weight_dtype(self.precision)).removeprefix("torch."),
            weight_bytes=sum(p.numel() * p.element_size() for p in params),
        )

    def forward(self, x: np.ndarray) -> np.ndarray:
        """Run one batch (rows first) synchronously; returns float32 outputs with one row per input row."""
        t = torch.from_numpy(x)
        if self.device.type == "cuda":
            t = t.pin_memory().to(self.device, non_blocking=True)
        t = prec.cast_input(t, self.precision)
        with prec.inference(self.precision, self.device):
            y = self.model(t)
        if not isinstance(y, torch.Tensor):
            raise EngineError(f"model returned {type(y).__name__}, expected a tensor")
        if y.shape[0] != x.shape[0]:
            raise EngineError(f"batch size mismatch: model returned {y.shape[0]} rows for {x.shape[0]} inputs")
        self.forwards += 1
        # float() on the device halves the copy for half outputs' consumers and gives JSON a stable dtype.
        return y.float().cpu().numpy()

    def run_chunks(self, chunks: list[np.ndarray]) -> list[np.ndarray]:
        """Run the chunks of one batch as a single forward; returns one output per chunk."""
        if len(chunks) == 1:
            return [self.forward(chunks[0])]
        out = self.forward(np.concatenate(chunks))
        bounds = np.cumsum([len(c) for c in chunks])[:-1]
        return np.split(out, bounds)

    async def run(self, chunks: list[np.ndarray]) -> list[np.ndarray]:
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
