"""One engine instance: its worker thread, its CUDA stream, its staging buffers and CUDA graphs per batch bucket.

An :class:`~server.engine.Engine` owns the model and the precision policy and runs each batch on one of its
instances. Instances share the cast weights (read-only at inference) but nothing that a batch writes, so several can
run at once on one device: one instance's host-to-device copy overlaps another's kernels (Triton's instance groups).

On CUDA a batch's rows are copied into a pinned host buffer kept per (bucket, dtype), sent with a ``non_blocking``
copy on the instance's stream and cast on the device; the float32 output comes back through a pinned buffer the
same way. On a CPU the same staging path pads rows into a reused buffer (or hands a single unpadded chunk to torch
without a copy).
"""

from __future__ import annotations

import contextlib
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
        self._outputs: dict[tuple[int, ...], torch.Tensor] = {}
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
        dtype = torch.from_numpy(np.empty(0, dtype=chunks[0].dtype)).dtype
        key = (size, dtype)
        buf = self._staging.get(key)
        if buf is None:
            buf = torch.empty((size, *chunks[0].shape[1:]), dtype=dtype, pin_memory=self.cuda)
            self._staging[key] = buf
        # One call for all chunks: numpy lets go of the GIL once for the whole copy, not once per chunk.
        np.concatenate(chunks, out=buf.numpy()[:rows], casting="same_kind")
        if rows < size:
            buf[rows:].zero_()
        return buf

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        """Send a staged batch to the device on the current stream (a no-op on a CPU)."""
        if not self.cuda:
            return host
        return host.to(self.device, non_blocking=True)

    def fetch(self, y: torch.Tensor) -> np.ndarray:
        """The float32 host copy of a device output (a fresh array the caller may keep)."""
        y = y.float()
        if not self.cuda:
            return y.numpy()
        out = self._outputs.get(tuple(y.shape))
        if out is None:
            out = torch.empty(y.shape, dtype=torch.float32, pin_memory=True)
            self._outputs[tuple(y.shape)] = out
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
            static_out = forward(static_in).float()
        self.stream.synchronize()
        captured = Graph(graph, static_in, static_out, model, time.perf_counter() - start)
        self.graphs[size] = captured
        return captured

    def replay(self, graph: Graph, host: torch.Tensor) -> torch.Tensor:
        """Run a captured graph on a staged batch (same dtype as the capture's); returns its static float32 output."""
        graph.input.copy_(host, non_blocking=True)
        graph.graph.replay()
        return graph.output

    def close(self) -> None:
        self.executor.shutdown(wait=True)
        self.graphs.clear()
        self._staging.clear()
        self._outputs.clear()
