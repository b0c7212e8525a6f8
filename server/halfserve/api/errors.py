"""The errors both transports answer: an :class:`APIError` carries the status it is answered with on HTTP, which
gRPC answers with its code (:data:`halfserve.api.grpc.grpc_service.STATUS_CODES`); the data plane's domain errors map
onto one through their :class:`~halfserve.api.dataplane.refusals.Refusal` (:func:`from_exception`).

Neither FastAPI nor grpc: each transport's answers are its own (:mod:`halfserve.api.http.errors`,
:mod:`halfserve.api.grpc.grpc_service`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from halfserve.api.dataplane.refusals import Refusal, refused


class APIError(Exception):
    """An error to answer with ``status`` and ``{"error": message}``."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers


class HeldError(APIError):
    """An error whose answer waits until ``hold`` returns, on whichever protocol answers it: a wrong admin token past
    the lockout's limit (:class:`~halfserve.api.lockout.Tarpit`)."""

    def __init__(
        self, status: int, message: str, headers: dict[str, str] | None, hold: Callable[[], Awaitable[None]]
    ) -> None:
        super().__init__(status, message, headers)
        self.hold = hold


async def held(e: BaseException) -> None:
    """Wait as long as ``e`` asks before it is answered (at once for any error but a :class:`HeldError`)."""
    if isinstance(e, HeldError):
        await e.hold()


STATUSES: dict[Refusal, int] = {
    Refusal.INVALID: 400,
    Refusal.NOT_FOUND: 404,
    Refusal.TOO_LARGE: 413,
    Refusal.UNAVAILABLE: 503,
    Refusal.TIMED_OUT: 504,
    Refusal.NO_ROOM: 507,
    Refusal.FAILED: 500,
}
"""The HTTP status of each refusal."""


def from_exception(e: Exception) -> APIError:
    """Map an error raised below the routes (:mod:`halfserve.serving`'s domain errors) onto its HTTP status."""
    if isinstance(e, APIError):
        return e
    answer = refused(e)
    return APIError(STATUSES[answer.refusal], answer.message, {"Retry-After": "1"} if answer.retry else None)
