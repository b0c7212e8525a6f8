"""An in-process engine's runner for a placement (:func:`place`): what the repository builds once
:func:`halfserve.placement.choose` has chosen."""

from __future__ import annotations

from halfserve.engine.core import Engine
from halfserve.engine.loop import LoopRunner
from halfserve.engine.pipelined import PipelinedRunner
from halfserve.engine.protocol import BatchRunner
from halfserve.engine.threads import ThreadRunner
from halfserve.placement import Placement


def runner(engine: Engine, placement: Placement, max_batch_size: int) -> BatchRunner:
    """The runner that runs ``engine``'s batches where ``placement`` says. Raises ``ValueError`` for a placement the
    engine cannot take, and :class:`~halfserve.engine.traced.TraceRefused` when beside the loop its model cannot be
    traced."""
    if placement is Placement.INSTANCE_PROCESSES:
        raise ValueError("an engine's instances run in processes of their own only as halfserve.isolated's engine")
    if placement is Placement.EVENT_LOOP:
        return LoopRunner(engine)
    if placement is Placement.BESIDE_LOOP:
        return PipelinedRunner.trace(engine, max_batch_size)
    return ThreadRunner(engine.instances, engine.run_batch)


def place(engine: Engine, placement: Placement, max_batch_size: int) -> None:
    """Run ``engine``'s batches where ``placement`` says from now on; on an error (:func:`runner`'s) nothing changes."""
    engine.runner = runner(engine, placement, max_batch_size)
