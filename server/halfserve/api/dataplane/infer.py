"""The one way an inference reaches a model, for ``/predict``, V2 over HTTP and V2 over gRPC alike.

A route decodes its request, then awaits :func:`infer`: the request is queued with its deadline, and whatever stops
it is answered the same whichever protocol carried it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import cast

from halfserve.api.dataplane.deadline import within
from halfserve.api.dataplane.refusals import cut_off_by_shutdown
from halfserve.errors import InternalError, ServingError
from halfserve.serving import AppState, ModelHandle, Prediction, Tensors


async def infer(
    app: AppState, served: ModelHandle, inputs: Tensors | Awaitable[Tensors], timeout: float | None
) -> Prediction:
    """``inputs`` run through ``served`` within ``timeout`` seconds (the client's and the request's own, the shorter;
    the model's ``request_timeout_ms`` bounds it too); ``inputs`` may be the awaitable that decodes them (``/predict``
    tokenizes its texts here, so that a drain cutting the tokenizing off is answered as one cutting the wait off), its
    wait for the decoding threads bounded by the same deadline (:func:`~halfserve.api.dataplane.deadline.within`).

    A client gone (its task cancelled) cancels the future the model gave, which withdraws the rows not yet running,
    and the cancellation goes on up; during a drain, past its timeout, the same cancellation is raised as
    :func:`~halfserve.api.dataplane.refusals.cut_off_by_shutdown` (to send again). A refusal before queueing (not
    ready, queue full), a passed deadline and every other domain error go on up as they are, for the transport to
    answer (:func:`~halfserve.api.dataplane.refusals.refused`); anything else as an
    :class:`~halfserve.errors.InternalError` naming its type.
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
