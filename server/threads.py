"""The cores torch may use in this process."""

from __future__ import annotations

import os


def available_cores() -> int:
    """Every core this process may run on (its affinity, which a container's CPU set narrows): torch's intra-op
    threads when none are set, before each engine settles its own (:meth:`server.engine.Engine.settle_threads`)."""
    return len(os.sched_getaffinity(0))
