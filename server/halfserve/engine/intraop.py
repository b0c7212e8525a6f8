"""torch's intra-op threads for an engine's instances: set on a thread for good, and the count a timed forward of a
full batch settles on (:func:`halfserve.placement.intra_op_threads` decides it from the timing).

The count is each thread's own setting (OpenMP's), so it is set on the instance's own thread, the only one that runs
its forwards; other threads (and other models' instances) keep theirs.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from halfserve.placement import intra_op_threads, loop_bound

log = logging.getLogger(__name__)

ForwardTiming = Callable[[int], float]
"""The seconds a full batch's forward takes on a given count of intra-op threads
(:meth:`halfserve.engine.core.Engine.settle_threads`)."""


def set_intra_op_threads(count: int) -> None:
    """Set the calling thread's torch intra-op threads to ``count``, for good.

    torch gives a thread its count from the process's last setting (any thread's) when the thread first asks for it
    or starts parallel work, overwriting a count set on the thread before that. Asking first spends that first time
    here, so the count set is the thread's until it sets another.
    """
    torch.get_num_threads()
    torch.set_num_threads(count)


def fixed_timing(seconds: float) -> ForwardTiming:
    """A :data:`ForwardTiming` that gives ``seconds`` at any thread count."""
    return lambda threads: seconds


@dataclass(frozen=True)
class Settled:
    """What :func:`settle` chose on one instance's thread, and the timing it chose from."""

    threads: int
    """The intra-op threads chosen, set on the thread."""
    warmed_at: int
    """The thread's count before: the one it warmed up (and compiled) at."""
    loop_bound: bool
    """Whether the forward on every core is shorter than the event loop's work on its requests
    (:func:`halfserve.placement.loop_bound`)."""
    batch_seconds: float
    """The forward's seconds at :attr:`threads`."""


def settle(
    forward: Callable[[], object], label: str, rows: int, cores: int, timing: ForwardTiming | None = None
) -> Settled:
    """On the calling thread (an instance's own): time ``forward``, a full batch of ``rows``, on all ``cores`` (or
    take ``timing``'s seconds instead), and set the thread's intra-op threads to the count
    :func:`~halfserve.placement.intra_op_threads` chooses from it. ``label`` names the instance in the log."""

    def timed(threads: int) -> float:
        if timing is not None:
            return timing(threads)
        seconds = math.inf
        for _ in range(3):
            start = time.perf_counter()
            forward()
            seconds = min(seconds, time.perf_counter() - start)
        return seconds

    warmed_at = torch.get_num_threads()
    set_intra_op_threads(cores)
    if timing is None:
        forward()  # the first at this count is not timed
    seconds = timed(cores)
    threads = intra_op_threads(seconds, rows, cores)
    log.info(
        "%s: a forward of %d rows took %.2f ms on %d threads: %d intra-op threads",
        label,
        rows,
        seconds * 1000,
        cores,
        threads,
    )
    set_intra_op_threads(threads)
    at_threads = seconds if threads == cores else timed(threads)
    return Settled(threads, warmed_at, loop_bound(seconds, rows), at_threads)
