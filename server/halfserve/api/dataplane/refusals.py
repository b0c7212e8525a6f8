"""Why a request is refused, in no transport's terms: each transport maps a :class:`Refusal` once, HTTP onto a status
(:data:`halfserve.api.errors.STATUSES`), gRPC onto a status code (:data:`halfserve.api.grpc.grpc_service.CODES`),
with the same message.

The data plane raises :mod:`halfserve.errors`'s domain errors; :func:`refused` says what each means to a client.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from halfserve.errors import (
    BatchFailedError,
    DeadlineExceededError,
    InternalError,
    InvalidInputError,
    ModelNotFoundError,
    ModelNotReadyError,
    OverLimitError,
    QueueFullError,
    RegionError,
    RegionFullError,
    RequestTooLargeError,
    ServerResourceError,
    ShuttingDownError,
)


class Refusal(Enum):
    """What kind of refusal a client gets, whichever transport carries it."""

    INVALID = "invalid"
    """The request is malformed or does not match the model: sending it again cannot help."""
    UNAUTHENTICATED = "unauthenticated"
    """A management call without the admin token, or with a wrong one."""
    FORBIDDEN = "forbidden"
    """A call this server takes from no one (management with no admin token configured)."""
    NOT_FOUND = "not found"
    TOO_LARGE = "too large"
    """Over a limit of the server's settings or of a model's queue."""
    TOO_MANY = "too many"
    """Too many calls at once, or wrong admin tokens lately, from the client or from everyone: back off."""
    TOO_SLOW = "too slow"
    """The client sent its request too slowly, or nothing for too long."""
    UNAVAILABLE = "unavailable"
    """Not now: a model loading, a full queue, a drain, the server out of file descriptors."""
    TIMED_OUT = "timed out"
    NO_ROOM = "no room"
    """A shared memory object's file system is full."""
    FAILED = "failed"
    """The server failed: the client's request may have been fine."""


@dataclass(frozen=True)
class Refused:
    """A refusal as a client is told it: its kind, the message, and whether sending it again may succeed, in how many
    seconds."""

    refusal: Refusal
    message: str
    retry: bool = False
    retry_after: int = 1


def refused(e: Exception) -> Refused:
    """What the error ``e``, raised below the transports, tells the client (anything unexpected: an internal error)."""
    if isinstance(e, ModelNotFoundError):  # ModelUnavailableError too: Triton's "no available versions"
        return Refused(Refusal.NOT_FOUND, str(e))
    if isinstance(e, ModelNotReadyError):
        return Refused(Refusal.UNAVAILABLE, str(e), e.retry, e.retry_after)
    if isinstance(e, InvalidInputError):
        return Refused(Refusal.INVALID, str(e))
    if isinstance(e, OverLimitError):
        return Refused(Refusal.TOO_LARGE, str(e))
    if isinstance(e, RegionFullError):
        return Refused(Refusal.NO_ROOM, str(e))
    if isinstance(e, RegionError):
        return Refused(Refusal.INVALID, str(e))
    if isinstance(e, InternalError):
        return Refused(Refusal.FAILED, f"internal error: {e}")
    if isinstance(e, ServerResourceError):
        return Refused(Refusal.UNAVAILABLE, str(e), retry=True, retry_after=e.retry_after)
    if isinstance(e, QueueFullError):
        return Refused(Refusal.UNAVAILABLE, str(e), retry=True)
    if isinstance(e, RequestTooLargeError):
        return Refused(Refusal.TOO_LARGE, f"inputs: {e}")
    if isinstance(e, ShuttingDownError):
        return Refused(Refusal.UNAVAILABLE, str(e), e.retry)
    if isinstance(e, DeadlineExceededError):
        return Refused(Refusal.TIMED_OUT, str(e))
    if isinstance(e, BatchFailedError):
        return Refused(Refusal.FAILED, f"inference failed: {e}")
    return Refused(Refusal.FAILED, f"internal error: {type(e).__name__}: {e}")


def cut_off_by_shutdown() -> ShuttingDownError:
    """The error of a request the server cancelled because the drain timeout passed during shutdown.

    Left to itself, uvicorn answers a cancelled request with a plain-text 500; inference is idempotent, so it is
    refused as one to send again, to another replica.
    """
    return ShuttingDownError(
        "server is shutting down: the drain timeout passed before this request was answered", retry=True
    )


def count(value: object, field: str, what: str = "a non-negative integer") -> int:
    """``value`` when it is a non-negative integer (not a boolean), else an invalid input naming ``field`` and
    ``what``."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InvalidInputError(f"{field}: expected {what}, got {value!r}")
    return value
