"""Batches as a traced graph beside the event loop (:attr:`~halfserve.placement.Placement.BESIDE_LOOP`): launched into
torch's inter-op pool and collected by the loop, two batches of up to half ``max_batch_size`` in flight, so the loop
reads and answers one batch's requests while the other runs (:mod:`halfserve.engine.traced`)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import numpy as np
import torch

from halfserve import precision as prec
from halfserve.engine.core import Engine
from halfserve.engine.rows import checked
from halfserve.engine.traced import TracedForward
from halfserve.placement import Placement
from halfserve.serving import Outcome


@dataclass
class _Running:
    """A batch launched as a traced graph: kept, with its input, until :meth:`PipelinedRunner._collect` answers it."""

    graph: torch.Future[torch.Tensor]
    batch: torch.Tensor
    chunks: list[np.ndarray]
    future: asyncio.Future[list[Outcome]]


class PipelinedRunner:
    """Launches each batch's traced forward from the event loop and answers it once the loop finds it done."""

    placement = Placement.BESIDE_LOOP

    def __init__(self, engine: Engine, traced: TracedForward) -> None:
        self._engine = engine
        self._traced = traced
        self._launched: list[_Running] = []
        self._collecting = False

    @classmethod
    def trace(cls, engine: Engine, max_batch_size: int) -> PipelinedRunner:
        """Trace ``engine``'s forward and run its batches beside the loop. Raises
        :class:`~halfserve.engine.traced.TraceRefused` when the model cannot run as a traced graph, and ``ValueError``
        for an engine that cannot be traced (:attr:`~halfserve.engine.core.Engine.traceable`).

        The trace is checked on three batches: a full one of zeros (the warm-up's), one row, and a full one of
        values drawn at random.
        """
        if not engine.traceable:
            raise ValueError(
                "only a CPU engine with one instance and one input, not padded, compiled or autocast, runs beside "
                "the event loop"
            )
        engine.take_threads()  # the inter-op pool's threads take the caller's count when they start
        zeros = torch.from_numpy(engine.warm_batch(max_batch_size))
        if zeros.dtype.is_floating_point:
            drawn = torch.from_numpy(np.random.default_rng(0).standard_normal(zeros.shape).astype(zeros.numpy().dtype))
        else:
            drawn = torch.randint(0, 2, zeros.shape, dtype=zeros.dtype, generator=torch.Generator().manual_seed(0))
        with prec.inference(engine.precision, engine.device):
            traced = TracedForward.trace(engine.model, engine.eager, [zeros, zeros[:1].clone(), drawn])
        # The pool's threads start now, taking this thread count (OpenMP's is a setting of each thread).
        traced.launch(zeros).wait()
        return cls(engine, traced)

    def batches(self, max_batch_size: int) -> tuple[int, int]:
        """Two in flight, each of up to half the rows: one is read and answered while the other runs (a whole batch
        would leave the loop nothing to do while it ran)."""
        return max(1, max_batch_size // 2), 2

    def run(self, chunks: list[np.ndarray]) -> asyncio.Future[list[Outcome]]:
        """Launch a batch's traced forward and return the future of its outcomes, set when :meth:`_collect` finds the
        graph done."""
        loop = asyncio.get_running_loop()
        # A batch of its own (the instance's staging buffer would be shared by the two batches in flight).
        batch = torch.from_numpy(chunks[0] if len(chunks) == 1 else np.concatenate(chunks))
        future: asyncio.Future[list[Outcome]] = loop.create_future()
        try:
            self._launched.append(_Running(self._traced.launch(batch), batch, chunks, future))
        except Exception as e:
            future.set_exception(e)
            return future
        if not self._collecting:
            self._collecting = True
            loop.call_soon(self._collect)
        return future

    def _collect(self) -> None:
        """Answer the launched batches whose graphs are done; look again at the loop's next iteration while any runs.

        The loop looks rather than being told: a callback from the pool's thread would wait for the GIL, which the
        loop, busy with requests, seldom lets go of long enough. Between requests the look costs a call per iteration.
        """
        engine, inst = self._engine, self._engine.instances[0]
        running = []
        for r in self._launched:
            if not r.graph.done():
                running.append(r)
                continue
            inst.forwards += 1
            if r.future.done():
                continue
            try:
                out = inst.fetch(checked(r.graph.value(), len(r.batch)), widen=engine.out_float)
                r.future.set_result(engine.guard.outcomes(r.chunks, out))
            except Exception as e:
                r.future.set_exception(e)
        self._launched = running
        if running:
            asyncio.get_running_loop().call_soon(self._collect)
        else:
            self._collecting = False
