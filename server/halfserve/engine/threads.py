"""Batches on the instances' own threads (:attr:`~halfserve.placement.Placement.INSTANCE_THREADS`), the default: each
batch goes to an idle instance's worker thread, so device work stays off the event loop (torch releases the GIL
during kernels) and the next batch forms while this one computes."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import numpy as np

from halfserve.instance import Instance
from halfserve.placement import Placement
from halfserve.serving import Outcome

RunBatch = Callable[[list[np.ndarray], Instance], list[Outcome]]
"""Runs one batch synchronously on an instance: :meth:`halfserve.engine.core.Engine.run_batch`."""


class ThreadRunner:
    """Hands each batch to an idle instance's thread."""

    placement = Placement.INSTANCE_THREADS

    def __init__(self, instances: list[Instance], run_batch: RunBatch) -> None:
        self._instances = instances
        self._run_batch = run_batch
        self._idle = list(reversed(instances))
        self._next = 0

    def run(self, chunks: list[np.ndarray]) -> asyncio.Future[list[Outcome]]:
        """Run a batch on an idle instance's thread without blocking the event loop: the future of its outcomes.

        The batch is on the instance's thread when this returns (a coroutine would hand it over only when its task
        first ran, behind whatever the event loop has queued). The batcher keeps at most one batch in flight per
        instance, so an idle one is normally at hand; past that (a caller running more at once) batches queue on the
        instances in turn.
        """
        if self._idle:
            inst = self._idle.pop()
        else:
            inst = self._instances[self._next % len(self._instances)]
            self._next += 1
        try:
            future = asyncio.get_running_loop().run_in_executor(inst.executor, self._run_batch, chunks, inst)
        except BaseException:
            self._idle_again(inst)
            raise
        # Registered before any caller awaits the future, so the instance is idle again before the caller resumes.
        future.add_done_callback(lambda _: self._idle_again(inst))
        return future

    def batches(self, max_batch_size: int) -> tuple[int, int]:
        """One batch in flight per instance, each taking the next batch when it is idle."""
        return max_batch_size, len(self._instances)

    def _idle_again(self, inst: Instance) -> None:
        if inst not in self._idle:
            self._idle.append(inst)
