"""Batches on the event loop's own thread (:attr:`~halfserve.placement.Placement.EVENT_LOOP`): for a CPU forward
shorter than the loop's work on its requests, where handing it to a thread and back would cost more than it runs.

Forwards that run far past what placed it there (an input that makes the model slow) hold up every other request
meanwhile; once they hold up the loop past their budget (:class:`~halfserve.placement.LoopStalls`), the runner hands
the engine's batches to its instance's thread for good, and says so in the log and in the engine's
:attr:`~halfserve.engine.core.Engine.placement_changed`."""

from __future__ import annotations

import asyncio
import logging
import time

import numpy as np

from halfserve.engine.core import Engine
from halfserve.engine.threads import ThreadRunner
from halfserve.placement import (
    LOOP_STALL_BUDGET_SECONDS,
    LOOP_STALL_FACTOR,
    LOOP_STALL_FLOOR_SECONDS,
    LOOP_STALL_WINDOW_SECONDS,
    LoopStalls,
    Placement,
    StallRun,
    loop_stall_bound,
)
from halfserve.serving import Outcome

log = logging.getLogger(__name__)


class LoopRunner:
    """Runs each batch where it is handed over, on the engine's one instance, until forwards that run long hold up the
    loop past their budget."""

    placement = Placement.EVENT_LOOP

    def __init__(self, engine: Engine) -> None:
        """Raises ``ValueError`` for an engine that is not on a CPU with one instance: several instances run batches
        side by side, each on its thread, and a GPU's launches would hold up the loop."""
        if engine.device.type != "cpu" or len(engine.instances) != 1:
            raise ValueError("only a CPU engine with one instance runs its batches on the event loop")
        self._engine = engine
        self.stalls = LoopStalls(loop_stall_bound(engine.batch_seconds))
        """The forwards here that ran long, and whether they held up the loop for long enough to leave it."""

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
        end = time.perf_counter()
        if end - start > self.stalls.bound:
            self.ran_long(end, end - start, sum(len(c) for c in chunks))
        return future

    def ran_long(self, now: float, seconds: float, rows: int) -> None:
        """A forward of ``rows`` here took ``seconds``, past :attr:`LoopStalls.bound`, and ended at ``now``
        (:func:`time.perf_counter`): noted, and where the forwards that ran long hold up the loop past their budget,
        the engine's batches run on its instance's thread from now on. The batcher keeps one batch in flight either
        way (:meth:`batches`, :meth:`ThreadRunner.batches` of one instance)."""
        engine = self._engine
        bound_ms = self.stalls.bound * 1000
        run = self.stalls.note(now, seconds)
        if run is None:
            log.info(
                "model %s: a forward of %d row(s) on the event loop's thread took %.3f s (bound %.0f ms); its batches "
                "leave the loop once such forwards, less the longest, take %.0f ms within %.0f s",
                engine.name,
                rows,
                seconds,
                bound_ms,
                LOOP_STALL_BUDGET_SECONDS * 1000,
                LOOP_STALL_WINDOW_SECONDS,
            )
            return
        engine.placement_changed = f"moved from event_loop: {self._reason(run)}"
        engine.runner = ThreadRunner(engine.instances, engine.run_batch)
        log.warning(
            "model %s: %d forwards on the event loop's thread ran past %.0f ms, %.3f s together (the longest %.3f s) "
            "within %.3f s; its batches run on an instance thread from now on",
            engine.name,
            run.count,
            bound_ms,
            run.seconds,
            run.longest,
            run.span,
        )

    def _reason(self, run: StallRun) -> str:
        """Why the engine's batches left the loop, for :attr:`~halfserve.engine.core.Engine.placement_changed`."""
        timed = self._engine.batch_seconds
        bound = (
            "no warm-up forward was timed"
            if timed is None
            else f"the larger of {LOOP_STALL_FACTOR:g}x its warm-up forward of {timed * 1000:.2f} ms and "
            f"{LOOP_STALL_FLOOR_SECONDS * 1000:g} ms"
        )
        return (
            f"{run.count} forwards on the event loop's thread ran past their bound of {self.stalls.bound * 1000:.0f} "
            f"ms ({bound}) within {run.span:.3f} s, {run.seconds:.3f} s together; less the longest "
            f"({run.longest:.3f} s), past their budget of {LOOP_STALL_BUDGET_SECONDS * 1000:.0f} ms within "
            f"{LOOP_STALL_WINDOW_SECONDS:g} s (1% of a longer time)"
        )

    def batches(self, max_batch_size: int) -> tuple[int, int]:
        """One batch at a time: the loop runs it before it reads the next requests."""
        return max_batch_size, 1
