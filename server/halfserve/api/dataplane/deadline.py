"""A request's deadline: the shortest of the client's (a header, a gRPC deadline, V2 ``parameters.timeout``) and the
model's ``request_timeout_ms``, and the wait for the threads that decode its photos or tokenize its texts held to it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from halfserve.errors import DeadlineExceededError
from halfserve.serving import ModelHandle

T = TypeVar("T")


def shortest(served: ModelHandle, timeout: float | None) -> float | None:
    """Seconds a request to ``served`` may wait: ``timeout`` (the client's) or the model's ``request_timeout_ms``,
    the shorter; None for neither."""
    model_ms = served.batching.request_timeout_ms
    limits = [t for t in (timeout, None if model_ms is None else model_ms / 1000) if t is not None]
    return min(limits) if limits else None


async def within(served: ModelHandle, work: Awaitable[T], timeout: float | None) -> tuple[T, float | None]:
    """``work`` (a request's photos decoded or texts tokenized, on threads shared by every request) awaited within the
    request's deadline (:func:`shortest` of ``timeout``, the client's, and the model's). The result, and the seconds
    left of that deadline for the model's queue (None: no deadline); past it, :class:`DeadlineExceededError` (the
    work is withdrawn from the threads' queue, or its result dropped), as for a request whose deadline passes in the
    queue."""
    limit = shortest(served, timeout)
    if limit is None:
        return await work, None
    loop = asyncio.get_running_loop()
    start = loop.time()
    try:
        done = await asyncio.wait_for(work, limit)
    except TimeoutError:
        raise DeadlineExceededError("deadline passed while the request waited to be decoded") from None
    return done, max(0.0, limit - (loop.time() - start))
