"""What the repository, the batcher, the fidelity check and the metrics use of a model's engine, whatever runs its
batches: :class:`ModelEngine` (an in-process :class:`~halfserve.engine.core.Engine`, or instance processes'
:class:`~halfserve.isolated.engine.ProcessEngine`), the :class:`BatchRunner` each placement's strategy is, and the
errors an engine raises for a batch.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from halfserve.compilecache import CacheOutcome
from halfserve.manifest import OverflowPolicy, Precision
from halfserve.placement import Placement
from halfserve.serving import Outcome


class EngineError(RuntimeError):
    """The model's forward failed or returned something other than one output row per input row."""


class PrecisionOverflowError(EngineError):
    """A half-precision output was not finite for a finite input, and the model's overflow policy is ``error``."""


@dataclass(frozen=True)
class EngineInfo:
    """What an engine serves, for listings and responses."""

    device: str
    precision: Precision
    weight_dtype: str
    weight_bytes: int
    fp32_fallback_bytes: int = 0
    """Host memory held by the fp32 copy kept for overflow reruns (0 when none is kept)."""
    instances: int = 1
    buckets: tuple[int, ...] = ()
    """The batch sizes batches are padded up to (empty: no padding)."""
    cuda_graphs: bool = False
    channels_last: bool = False
    graph_capture_seconds: float = 0.0
    """Time spent capturing CUDA graphs at warm-up, all buckets and instances together."""
    inductor: bool = False
    aoti: bool = False
    """Whether the forward runs AOTInductor packages (:mod:`halfserve.aoti`)."""
    inductor_compile_seconds: float = 0.0
    """Time spent compiling with TorchInductor at warm-up (each bucket's first forward, or the AOTInductor
    packages' build), all buckets together."""
    compile_cache: CacheOutcome = CacheOutcome.OFF
    """What the warm-up found in the compile cache (:mod:`halfserve.compilecache`)."""
    compile_cache_load_seconds: float = 0.0
    compiled_graphs: int = 0
    """FX graphs TorchInductor compiled at warm-up (none when the compile cache had them)."""
    cached_graphs: int = 0
    """FX graphs found in torch's caches at warm-up instead of compiled."""
    placement: Placement = Placement.INSTANCE_THREADS
    """Where batches run (:mod:`halfserve.placement`)."""
    placement_changed: str | None = None
    """Why :attr:`placement` is no longer the one chosen at load (None while it is)."""


class BatchRunner(Protocol):
    """One placement's way of running an engine's batches (:mod:`halfserve.engine.threads`,
    :mod:`~halfserve.engine.loop`, :mod:`~halfserve.engine.pipelined`)."""

    @property
    def placement(self) -> Placement: ...

    def run(self, chunks: list[np.ndarray]) -> asyncio.Future[list[Outcome]]:
        """Start a batch without blocking the event loop: the future of one outcome per chunk (the runner contract,
        :data:`halfserve.serving.Runner`)."""
        ...

    def batches(self, max_batch_size: int) -> tuple[int, int]:
        """The most rows in one batch for a model's ``max_batch_size``, and how many batches may be in flight."""
        ...


class Counted(Protocol):
    """An instance as the statistics see it."""

    @property
    def forwards(self) -> int: ...


class ModelEngine(Protocol):
    """A model's engine, as the repository builds, serves, measures and releases it."""

    @property
    def device(self) -> torch.device: ...
    @property
    def precision(self) -> Precision: ...
    @property
    def overflow(self) -> OverflowPolicy: ...
    @property
    def info(self) -> EngineInfo: ...
    @property
    def instances(self) -> Sequence[Counted]: ...
    @property
    def forwards(self) -> int: ...
    @property
    def overflows(self) -> int: ...
    @property
    def fp32_reruns(self) -> int: ...

    real_elements: int
    """Values of variable inputs run so far that requests sent (reset once load-time batches are done)."""
    padded_elements: int
    """Values run so far that were padding."""

    @property
    def available(self) -> bool:
        """Whether an instance can run a batch now."""
        ...

    def batches(self, max_batch_size: int) -> tuple[int, int]: ...

    def run(self, chunks: list[np.ndarray]) -> asyncio.Future[list[Outcome]]: ...

    def compute(self, x: np.ndarray) -> np.ndarray:
        """The model's outputs for ``x`` as one batch, without the overflow policy (the fidelity check's forward);
        blocks, so call it off the event loop."""
        ...

    def close(self) -> None: ...
