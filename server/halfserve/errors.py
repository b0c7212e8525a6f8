"""The errors a request can fail with below the transports, and how they cross between processes.

The domain errors (:class:`ServingError` and its kinds) are the serving contract's (:mod:`halfserve.serving`): the
data plane, the batcher, the repository and the engine raise them, a transport maps each onto its refusal
(:mod:`halfserve.api.dataplane.refusals`), and the multi-process wire carries them by name (:func:`error_to_wire`).
Beside them, the two a runner raises for the batcher to act on (:class:`BatchTooLargeError`,
:class:`InstanceLostError`). Neutral: no HTTP, no torch, nothing of the server's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

# Domain errors --------------------------------------------------------------------------------------------------------


class ServingError(Exception):
    """Base of the errors a request can fail with below the transports; each maps onto one refusal
    (:class:`~halfserve.api.dataplane.refusals.Refusal`), which each transport answers in its own terms."""


class ModelNotFoundError(ServingError, LookupError):
    """No model of that name is known to the server."""


class ModelUnavailableError(ModelNotFoundError):
    """The model is known, but no version of it can serve: it failed to load, or was unloaded."""


class ModelNotReadyError(ServingError, RuntimeError):
    """The model is known but cannot take requests now (loading, draining, or reloaded under the request).

    ``retry`` says whether the same request may succeed if sent again in a moment (a ``Retry-After``), and
    ``retry_after`` in how many seconds.
    """

    def __init__(self, message: str, retry: bool = True, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry = retry
        self.retry_after = retry_after


class InvalidInputError(ServingError, ValueError):
    """The request does not match the model or the protocol: a missing, unexpected or misshapen tensor, a malformed
    field (the message names it)."""


class IdOutOfRangeError(InvalidInputError):
    """An integer input holds an id outside the embedding table it indexes (:mod:`halfserve.indices`), found where the
    request's rows reach the model, below the routes: the message names the row by the column format's ``inputs``;
    :meth:`in_rows` names it as a route of the row format does (KServe V1's ``instances``)."""

    def __init__(self, name: str, row: int, value: int, rows: int) -> None:
        self.name, self.row, self.value, self.rows = name, row, value, rows
        super().__init__(f"inputs: input {name!r} row {row} holds {value}, {self._outside()}")

    def _outside(self) -> str:
        return f"outside 0..{self.rows - 1}: the ids the model's embedding of {self.rows} rows takes"

    def in_rows(self, field: str) -> InvalidInputError:
        """The refusal naming the row as ``field[row]``."""
        return InvalidInputError(f"{field}[{self.row}]: input {self.name!r} holds {self.value}, {self._outside()}")


class OverLimitError(ServingError):
    """The request carries more than one of the server's limits allows (rows, values, text bytes), refused before it
    is queued, or a registration would pass one (``max_shm_regions``); the message names the field and the setting."""


class BatchingError(ServingError):
    """Base class of the errors a queued request can fail with."""


class QueueFullError(BatchingError):
    """The queue holds ``max_queue_rows`` rows; the request was not accepted."""


class DeadlineExceededError(BatchingError):
    """The request's deadline passed while it was queued; it was never run."""


class HandlerTimeLimitError(DeadlineExceededError):
    """A handler's ``preprocess`` or ``postprocess`` call ran past its ``timeout_s``: a 504 as a deadline is, but one
    request of a batch of several may have caused it (its payloads the slow ones), so each is rerun alone."""


class ShuttingDownError(BatchingError):
    """The batcher is draining and accepts no new requests, or a drain's timeout cut the request off.

    ``retry`` says whether the same request may succeed if sent again (to another replica, after a ``Retry-After``):
    a request cut off by the drain was accepted, and inference is idempotent.
    """

    def __init__(self, message: str, retry: bool = False) -> None:
        super().__init__(message)
        self.retry = retry


class BatchFailedError(BatchingError):
    """The runner failed on this request's rows (alone: other requests of the batch were rerun without it)."""


class RequestTooLargeError(BatchingError):
    """The request has more rows than the queue can ever hold; retrying cannot help."""


class RegionError(ServingError, ValueError):
    """A shared memory region cannot be opened, read or written as asked (a client's mistake, or its object shrank)."""


class RegionFullError(RegionError):
    """The file system holding a shared memory object has no room for an output written into it."""


class ServerResourceError(ServingError):
    """The server is out of a resource of its own (file descriptors, at its open-file limit) that the request needs:
    its shortage, not the client's mistake, and one that may pass as other clients' connections close."""

    retry_after = 5
    """The seconds a client is told to wait (``Retry-After``): a shortage passes as connections close, which takes
    longer than a full queue's moment, and clients sent back sooner would only find it again."""


# A runner's errors: what the batcher acts on --------------------------------------------------------------------------


class BatchTooLargeError(Exception):
    """Raised by a runner that cannot run this many rows at once (the device is out of memory).

    The batcher halves its batch size for good and reruns the rows in smaller batches; only a single row that still
    does not fit fails its request.
    """


class InstanceLostError(Exception):
    """Raised by a runner whose instance died (or was killed, hung) running the batch: an instance process's end.

    Any of the batch's requests may have killed it, and a rerun that holds that request kills the next instance too,
    so the batcher reruns each chunk alone rather than in halves; a chunk that loses its instance alone fails its
    request without a retry.
    """


# Across processes -----------------------------------------------------------------------------------------------------


class InternalError(RuntimeError):
    """An unexpected failure in another process, carried as its ``"<type>: <message>"``."""


_WIRE_ERRORS: dict[str, type[ServingError]] = {
    cls.__name__: cls
    for cls in (
        ServingError,
        ModelNotFoundError,
        ModelUnavailableError,
        ModelNotReadyError,
        InvalidInputError,
        IdOutOfRangeError,
        OverLimitError,
        BatchingError,
        QueueFullError,
        DeadlineExceededError,
        HandlerTimeLimitError,
        ShuttingDownError,
        BatchFailedError,
        RequestTooLargeError,
        RegionError,
        RegionFullError,
        ServerResourceError,
    )
}


def error_to_wire(e: BaseException) -> dict[str, object]:
    """``e`` as another process can raise it again (:func:`error_from_wire`): its kind and message."""
    if isinstance(e, ServingError) and type(e).__name__ in _WIRE_ERRORS:
        wire: dict[str, object] = {"kind": type(e).__name__, "message": str(e)}
        if isinstance(e, ModelNotReadyError):
            wire["retry"] = e.retry
            wire["retry_after"] = e.retry_after
        if isinstance(e, IdOutOfRangeError):
            wire["id"] = [e.name, e.row, e.value, e.rows]
        return wire
    # Anything else failed inside the server: it answers as an internal error, under its own type's name.
    return {"kind": "internal", "message": f"{type(e).__name__}: {e}"}


def error_from_wire(wire: Mapping[str, object]) -> Exception:
    """The exception :func:`error_to_wire` described."""
    kind, message = wire.get("kind"), str(wire.get("message"))
    cls = _WIRE_ERRORS.get(kind) if isinstance(kind, str) else None
    if cls is ModelNotReadyError:
        after = wire.get("retry_after", 1)
        return ModelNotReadyError(message, bool(wire.get("retry", True)), after if isinstance(after, int) else 1)
    if cls is IdOutOfRangeError:
        name, row, value, rows = cast(list[Any], wire["id"])
        return IdOutOfRangeError(str(name), int(row), int(value), int(rows))
    if cls is not None:
        return cls(message)
    return InternalError(message)
