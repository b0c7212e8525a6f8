"""Batches on the event loop's own thread (:attr:`~halfserve.placement.Placement.EVENT_LOOP`): for a CPU forward
shorter than the loop's work on its requests, where handing it to a thread and back would cost more than it runs.

A forward that runs far past what placed it there (:func:`~halfserve.placement.leaves_loop`: an input that makes the
model slow) held up every other request meanwhile; the runner then hands the engine's batches to its instance's
thread for good, and says so in the log and in the engine's :attr:`~halfserve.engine.core.Engine.placement_changed`."""

from __future__ import annotations

import asyncio
import logging
import time

import numpy as np

from halfserve.engine.core import Engine
from halfserve.engine.threads import ThreadRunner
from halfserve.placement import LOOP_STALL_FACTOR, LOOP_STALL_FLOOR_SECONDS, Placement, leaves_loop, loop_stall_bound
from halfserve.serving import Outcome

log = logging.getLogger(__name__)


class LoopRunner:
    """Runs each batch where it is handed over, on the engine's one instance, until one runs past its bound."""

    placement = Placement.EVENT_LOOP

    def __init__(self, engine: Engine) -> None:
        """Raises ``ValueError`` for an engine that is not on a CPU with one instance: several instances run batches
        side by side, each on its thread, and a GPU's launches would hold up the loop."""
        if engine.device.type != "cpu" or len(engine.instances) != 1:
            raise ValueError("only a CPU engine with one instance runs its batches on the event loop")
        self._engine = engine
        self.bound = loop_stall_bound(engine.batch_seconds)
        """The longest a forward here may take before the engine's batches leave the loop (seconds)."""

    def run(self, chunks: list[np.ndarray]) -> asyncio.Future[list[Outcome]]:
        """Run a batch on this thread (the event loop's): its outcomes as a done future."""
        engine = self._engine
        engine.take_threads()  # the loop's thread takes the instance's count
        future: asyncio.Future[list[Outcome]] = asyncio.get_running_loop().create_future()
        start = time.perf_counter()
        try:
            future.set_result(engine.run_batch(chunks, engine.instances[0]))
        except Exception as e:
            future.set_exception(e)
        seconds = time.perf_counter() - start
        if leaves_loop(seconds, self.bound):
            self.leave(seconds, sum(len(c) for c in chunks))
        return future

    def leave(self, seconds: float, rows: int) -> None:
        """Run the engine's batches on its instance's thread from now on: a forward of ``rows`` here took
        ``seconds``, past :attr:`bound`. The batcher keeps one batch in flight either way
        (:meth:`batches`, :meth:`ThreadRunner.batches` of one instance)."""
        engine = self._engine
        timed = engine.batch_seconds
        why = (
            "no warm-up forward was timed"
            if timed is None
            else f"the larger of {LOOP_STALL_FACTOR:g}x its warm-up forward of {timed * 1000:.2f} ms and "
            f"{LOOP_STALL_FLOOR_SECONDS * 1000:g} ms"
        )
        engine.placement_changed = (
            f"moved from event_loop: a forward of {rows} row(s) on the event loop's thread took {seconds:.3f} s, "
            f"past its bound of {self.bound * 1000:.0f} ms ({why})"
        )
        engine.runner = ThreadRunner(engine.instances, engine.run_batch)
        log.warning(
            "model %s: a forward of %d row(s) on the event loop's thread took %.3f s (bound %.0f ms); its batches run "
            "on an instance thread from now on",
            engine.name,
            rows,
            seconds,
            self.bound * 1000,
        )

    def batches(self, max_batch_size: int) -> tuple[int, int]:
        """One batch at a time: the loop runs it before it reads the next requests."""
        return max_batch_size, 1
