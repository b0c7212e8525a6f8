"""Waiting for a condition in a test, always with a deadline.

A deadline here bounds a hang, it does not time anything: it is far longer than the wait takes on any host, and a
test that reaches it fails saying what it waited for instead of hanging until the suite's per-test timeout.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

DEADLINE_S = 60.0
"""How long a condition may take to hold before the test fails: a hang, not a slow host."""


def wait_until(condition: Callable[[], object], what: str, timeout: float = DEADLINE_S, every: float = 0.05) -> None:
    """Return once ``condition()`` is true, checking every ``every`` seconds; fail naming ``what`` after
    ``timeout``."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout:g} s: {what}"
        time.sleep(every)


async def until(condition: Callable[[], object], what: str, timeout: float = DEADLINE_S, every: float = 0.001) -> None:
    """:func:`wait_until` on an event loop: sleeps let the loop run what the condition waits for."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout:g} s: {what}"
        await asyncio.sleep(every)


async def freed(count: Callable[[], int], what: str) -> None:
    """Return once ``count()`` of objects still alive is 0, for a test that turned the collector off to see what only
    a collection would free. A worker thread drops its failed call, and the error it raised, a moment after it woke
    the event loop with it, so the answer can come back first; a cycle stays however long the wait."""
    await until(lambda: count() == 0, what, every=0.01)
