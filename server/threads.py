"""Where torch work runs off the event loop, and why not in the default executor.

OpenMP (torch's intra-op backend on CPU builds) gives every thread that runs a parallel region a pool of worker
threads, kept for as long as that thread lives. Once a process's pools hold more threads than it has cores, GNU
OpenMP stops spinning between parallel regions (its throttled spin count) and each region pays for waking its workers
again. A small model's forward is a few such regions: on a 2-core host, a bf16 MLP (256-1024-1024-10) forward of 64
rows took 0.28 ms on the engine's thread alone and 0.62 ms once any other long-lived thread had run torch work, in
fp32 0.97 against 1.4 ms; every forward after it, for the life of the process.

So torch work that is not a forward (loading a checkpoint, casting it, measuring fidelity) runs in a thread of its
own that ends with it (:func:`in_passing_thread`), not in ``asyncio.to_thread``'s long-lived executor, and the event
loop's thread runs none: the serving forwards then have the process's only OpenMP pool, the engine instance's.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


async def in_passing_thread(fn: Callable[..., T], *args: Any, name: str = "halfserve-load") -> T:
    """``fn(*args)`` in a new thread that ends when it returns, without blocking the event loop."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(value: Any, error: BaseException | None) -> None:
        if future.done():  # the caller was cancelled: nobody waits for the outcome
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(value)

    def run() -> None:
        value, error = None, None
        try:
            value = fn(*args)
        except BaseException as e:
            error = e
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: the process is ending
            loop.call_soon_threadsafe(settle, value, error)

    threading.Thread(target=run, name=name, daemon=True).start()
    return await future


def available_cores() -> int:
    """Every core this process may run on (its affinity, which a container's CPU set narrows): torch's intra-op
    threads when none are set, before each engine settles its own (:meth:`server.engine.Engine.settle_threads`)."""
    return len(os.sched_getaffinity(0))
