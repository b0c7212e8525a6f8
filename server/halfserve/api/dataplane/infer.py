"""The one way an inference reaches a model, for ``/predict``, V2 over HTTP and V2 over gRPC alike.

A route decodes its request, then awaits :func:`infer`: the request is queued with its deadline, and whatever stops
it is answered the same whichever protocol carried it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar, cast

from halfserve.api.dataplane.refusals import cut_off_by_shutdown
from halfserve.serving import (
    AppState,
    DeadlineExceededError,
    InternalError,
    ModelHandle,
    Prediction,
    ServingError,
    Tensors,
)

T = TypeVar("T")


async def within(served: ModelHandle, work: Awaitable[T], timeout: float | None) -> tuple[T, float | None]:
    """``work`` (a request's photos decoded or texts tokenized, on threads shared by every request) awaited within the
    request's deadline: ``timeout`` (the client's) and the model's ``request_timeout_ms``, the shorter. The result, and
    what is left of ``timeout`` for the model's queue; past the deadline, :class:`DeadlineExceededError` (the work is
    withdrawn from the threads' queue, or its result dropped), as for a request whose deadline passes in the queue."""
    model_ms = served.batching.request_timeout_ms
    limits = [t for t in (timeout, None if model_ms is None else model_ms / 1000) if t is not None]
    if not limits:
        return await work, None
    loop = asyncio.get_running_loop()
    start = loop.time()
    try:
        done = await asyncio.wait_for(work, min(limits))
    except TimeoutError:
        raise DeadlineExceededError("deadline passed while the request waited to be decoded") from None
    return done, None if timeout is None else max(0.0, timeout - (loop.time() - start))


async def infer(
    app: AppState, served: ModelHandle, inputs: Tensors | Awaitable[Tensors], timeout: float | None
) -> Prediction:
    """``inputs`` run through ``served`` within ``timeout`` seconds (the client's and the request's own, the shorter;
    the model's ``request_timeout_ms`` bounds it too); ``inputs`` may be the awaitable that decodes them (``/predict``
    tokenizes its texts here, so that a drain cutting the tokenizing off is answered as one cutting the wait off), its
    wait for the decoding threads bounded by the same deadline (:func:`within`).

    A client gone (its task cancelled) cancels the future the model gave, which withdraws the rows not yet running,
    and the cancellation goes on up; during a drain, past its timeout, the same cancellation is raised as
    :func:`~halfserve.api.dataplane.refusals.cut_off_by_shutdown` (to send again). A refusal before queueing (not
    ready, queue full), a passed deadline and every other domain error go on up as they are, for the transport to
    answer (:func:`~halfserve.api.dataplane.refusals.refused`); anything else as an
    :class:`~halfserve.serving.InternalError` naming its type.
    """
    try:
        given: Tensors
        if isinstance(inputs, dict):
            given = inputs
        else:
            given, timeout = await within(served, cast(Awaitable[Tensors], inputs), timeout)
        return await served.submit(given, timeout)
    except asyncio.CancelledError:
        if not app.draining:
            raise
        raise cut_off_by_shutdown() from None
    except (ServingError, InternalError):
        raise
    except Exception as e:
        raise InternalError(f"{type(e).__name__}: {e}") from None
