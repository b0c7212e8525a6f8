"""Batches on the event loop's own thread (:attr:`~halfserve.placement.Placement.EVENT_LOOP`): for a CPU forward
shorter than the loop's work on its requests, where handing it to a thread and back would cost more than it runs."""

from __future__ import annotations

import asyncio

import numpy as np

from halfserve.engine.core import Engine
from halfserve.placement import Placement
from halfserve.serving import Outcome


class LoopRunner:
    """Runs each batch where it is handed over, on the engine's one instance."""

    placement = Placement.EVENT_LOOP

    def __init__(self, engine: Engine) -> None:
        """Raises ``ValueError`` for an engine that is not on a CPU with one instance: several instances run batches
        side by side, each on its thread, and a GPU's launches would hold up the loop."""
        if engine.device.type != "cpu" or len(engine.instances) != 1:
            raise ValueError("only a CPU engine with one instance runs its batches on the event loop")
        self._engine = engine

    def run(self, chunks: list[np.ndarray]) -> asyncio.Future[list[Outcome]]:
        """Run a batch on this thread (the event loop's): its outcomes as a done future."""
        engine = self._engine
        engine.take_threads()  # the loop's thread takes the instance's count
        future: asyncio.Future[list[Outcome]] = asyncio.get_running_loop().create_future()
        try:
            future.set_result(engine.run_batch(chunks, engine.instances[0]))
        except Exception as e:
            future.set_exception(e)
        return future

    def batches(self, max_batch_size: int) -> tuple[int, int]:
        """One batch at a time: the loop runs it before it reads the next requests."""
        return max_batch_size, 1
