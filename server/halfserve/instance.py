"""One engine instance: its worker thread, its CUDA stream, its staging buffers and CUDA graphs per batch bucket.

An :class:`~halfserve.engine.core.Engine` owns the model and the precision policy and runs each batch on one of its
instances. Instances share the cast weights (read-only at inference) but nothing that a batch writes, so several can
run at once on one device: one instance's host-to-device copy overlaps another's kernels (Triton's instance groups).

On CUDA a batch's rows are copied into a pinned host buffer kept per (bucket, dtype), sent with a ``non_blocking``
copy on the instance's stream and cast on the device; the float32 output comes back through a pinned buffer the
same way. On a CPU the same staging path pads rows into a reused buffer (or hands a single unpadded chunk to torch
without a copy).
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

GRAPH_WARMUP_FORWARDS = 3
"""Eager forwards on the capture stream before a capture: cuDNN picks its algorithms and the allocator its blocks
outside the graph."""


_PINNED: dict[int, int] = {}
"""Start address -> end address of each buffer :func:`pin_host` page-locked."""


def pin_host(buffer: Any) -> Callable[[], None] | None:
    """Page-lock a writable host buffer (an ``mmap``, say) for CUDA, so that copies from arrays in it go straight to
    the device without a staging copy; returns the function that unpins it, or None where CUDA is absent or refused.

    The buffer stays exported (it cannot be closed or resized) until the returned function has run.
    """
    if not torch.cuda.is_available():
        return None
    t = torch.frombuffer(buffer, dtype=torch.uint8)
    cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
    start = t.data_ptr()
    if int(cudart.cudaHostRegister(start, t.numel(), 0)) != 0:
        return None
    _PINNED[start] = start + t.numel()

    def unpin() -> None:
        if _PINNED.pop(start, None) is not None:
            cudart.cudaHostUnregister(start)

    return unpin


@functools.cache
def torch_dtype(dtype: np.dtype[Any]) -> torch.dtype:
    """The torch dtype of a numpy dtype (asked once per batch: cached)."""
    return torch.from_numpy(np.empty(0, dtype=dtype)).dtype


def pinned(chunks: list[np.ndarray]) -> bool:
    """True when every chunk lies in a buffer :func:`pin_host` page-locked, so it can be copied to the device as it
    is. Pure Python on purpose: no torch call, which would let go of the GIL and wait to get it back."""
    if not _PINNED:
        return False
    for c in chunks:
        if not (c.flags.c_contiguous and c.flags.writeable):
            return False
        start = c.__array_interface__["data"][0]
        if not any(lo <= start and start + c.nbytes <= hi for lo, hi in _PINNED.items()):
            return False
    return True


def bucket_for(rows: int, buckets: list[int]) -> int:
    """The smallest bucket holding ``rows``; ``rows`` itself when it exceeds every bucket (or there are none)."""
    for size in buckets:
        if size >= rows:
            return size
    return rows


@dataclass
class Graph:
    """A CUDA graph captured for one bucket: write the batch into ``input``, replay, read ``output``."""

    graph: torch.cuda.CUDAGraph
    input: torch.Tensor
    output: torch.Tensor
    model: object
    """The module captured: a graph is replayed only while the engine still serves this very module."""
    capture_seconds: float


class Instance:
    """A worker thread and the device-side state of one engine instance."""

    def __init__(self, name: str, index: int, device: torch.device) -> None:
        self.index = index
        self.device = device
        self.cuda = device.type == "cuda"
        # The thread name keeps the engine's prefix so that logs and profilers show which model a thread serves.
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"engine-{name}-{index}")
        self.stream: torch.cuda.Stream | None = (
            torch.cuda.Stream(device) if self.cuda else None  # type: ignore[no-untyped-call]
        )
        self.graphs: dict[int, Graph] = {}
        # All of an instance's graphs replay one at a time on its stream, so they can share one memory pool.
        self._pool: Any = None
        self._staging: dict[tuple[int, torch.dtype], torch.Tensor] = {}
        self._device_staging: dict[tuple[int, torch.dtype], torch.Tensor] = {}
        self._outputs: dict[tuple[tuple[int, ...], torch.dtype], torch.Tensor] = {}
        self.forwards = 0

    @contextlib.contextmanager
    def on_stream(self) -> Iterator[None]:
        """Make the instance's stream current (no-op on a CPU)."""
        if self.stream is None:
            yield
            return
        with torch.cuda.stream(self.stream):
            yield

    def stage(self, chunks: list[np.ndarray], size: int) -> torch.Tensor:
        """The batch as one host tensor of ``size`` rows: the chunks' rows in order, then zero rows up to ``size``.

        Pinned on CUDA, so the copy to the device can be asynchronous. The buffer is reused by the next batch of the
        same bucket, which is safe because a batch's copies have finished (the output was synchronised) before the
        instance takes another.
        """
        rows = sum(len(c) for c in chunks)
        if not self.cuda and len(chunks) == 1 and rows == size:
            return torch.from_numpy(chunks[0])  # nothing to pad: no copy on a CPU
        key = (size, torch_dtype(chunks[0].dtype))
        buf = self._staging.get(key)
        if buf is None:
            buf = torch.empty((size, *chunks[0].shape[1:]), dtype=key[1], pin_memory=self.cuda)
            self._staging[key] = buf
        # One call for all chunks: numpy lets go of the GIL once for the whole copy, not once per chunk.
        np.concatenate(chunks, out=buf.numpy()[:rows], casting="same_kind")
        if rows < size:
            buf[rows:].zero_()
        return buf

    def upload(self, chunks: list[np.ndarray], size: int, into: torch.Tensor | None = None) -> torch.Tensor:
        """The batch on the device as ``size`` rows (zero rows after the chunks' rows), in ``into`` when given.

        Chunks in page-locked memory (a front-end's shared slots, pinned by the engine process) are copied to the
        device as they are, with no host-side copy; others are staged first (:meth:`stage`). Either way the copies
        are asynchronous on the current stream, and the chunks must stay unchanged until the stream has passed them
        (the engine answers a batch only after :meth:`fetch` has synchronised).
        """
        if not (self.cuda and pinned(chunks)):
            host = self.stage(chunks, size)
            if into is None:
                return self.to_device(host)
            into.copy_(host, non_blocking=True)
            return into
        if into is None:
            key = (size, torch_dtype(chunks[0].dtype))
            into = self._device_staging.get(key)
            if into is None:
                into = torch.empty((size, *chunks[0].shape[1:]), dtype=key[1], device=self.device)
                self._device_staging[key] = into
        # One torch call for all the copies: each call lets go of the GIL, and getting it back waits on the event
        # loop's thread, which is busy under load (tens of microseconds each time).
        sizes = [len(c) for c in chunks]
        rows = sum(sizes)
        parts = list(into[:rows].split(sizes))  # type: ignore[no-untyped-call]
        torch._foreach_copy_(parts, [torch.from_numpy(c) for c in chunks], non_blocking=True)
        if rows < size:
            into[rows:].zero_()
        return into

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        """Send a staged batch to the device on the current stream (a no-op on a CPU)."""
        if not self.cuda:
            return host
        return host.to(self.device, non_blocking=True)

    def fetch(self, y: torch.Tensor, widen: bool = True) -> np.ndarray:
        """The host copy of a device output (a fresh array the caller may keep): float32, or its own dtype when not
        ``widen`` (integer and bool outputs)."""
        if widen:
            y = y.float()
        if not self.cuda:
            return y.numpy()
        key = (tuple(y.shape), y.dtype)
        out = self._outputs.get(key)
        if out is None:
            out = torch.empty(y.shape, dtype=y.dtype, pin_memory=True)
            self._outputs[key] = out
        out.copy_(y, non_blocking=True)
        assert self.stream is not None
        self.stream.synchronize()  # CPU-GPU sync point: the only one per batch
        return out.numpy().copy()

    def capture(
        self, size: int, sample: torch.Tensor, forward: Callable[[torch.Tensor], torch.Tensor], model: object
    ) -> Graph:
        """Capture ``forward`` (of ``model``) for a device batch shaped like ``sample`` as the graph of ``size``."""
        assert self.stream is not None
        start = time.perf_counter()
        static_in = sample.clone()
        with self.on_stream():
            for _ in range(GRAPH_WARMUP_FORWARDS):
                forward(static_in)
        self.stream.synchronize()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # thread_local: another model's engine may be serving from its own thread while this one loads.
        with torch.cuda.graph(graph, pool=self._pool, stream=self.stream, capture_error_mode="thread_local"):
            y = forward(static_in)
            static_out = y.float() if y.is_floating_point() else y
        self.stream.synchronize()
        captured = Graph(graph, static_in, static_out, model, time.perf_counter() - start)
        self.graphs[size] = captured
        return captured

    def replay(self, graph: Graph, chunks: list[np.ndarray], size: int) -> torch.Tensor:
        """Run a captured graph on a batch (same dtype as the capture's); returns its static float32 output."""
        self.upload(chunks, size, into=graph.input)
        graph.graph.replay()
        return graph.output

    def close(self) -> None:
        self.executor.shutdown(wait=True)
        self.graphs.clear()
        self._staging.clear()
        self._device_staging.clear()
        self._outputs.clear()
