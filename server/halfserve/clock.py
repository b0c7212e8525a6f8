"""The batchers' time: what a batcher measures waits and deadlines with, and how it is woken later. A module of its
own, torch-free and asyncio-only, so that the model's batcher (:mod:`halfserve.batching`) and the handler batcher
(:mod:`halfserve.handlerbatch`, which the data plane runs and which must not load the model's batcher) share one
abstraction, and tests drive both with one fake clock."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Protocol


class Timer(Protocol):
    def cancel(self) -> None: ...


class Clock(Protocol):
    """A batcher's time: what it measures waits and deadlines with, and how it is woken later."""

    def now(self) -> float:
        """Seconds, on a clock that only moves forward."""

    def call_later(self, delay: float, callback: Callable[[], object]) -> Timer:
        """Call ``callback`` on the event loop once ``delay`` seconds have passed on this clock."""


class LoopClock:
    """``time.monotonic`` and the running event loop's timers (asyncio's loop time is ``time.monotonic``)."""

    @staticmethod
    def now() -> float:
        return time.monotonic()

    @staticmethod
    def call_later(delay: float, callback: Callable[[], object]) -> Timer:
        return asyncio.get_running_loop().call_later(delay, callback)
