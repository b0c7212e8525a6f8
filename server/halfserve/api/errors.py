"""The errors both transports answer. Code that either transport runs (the checks in :mod:`halfserve.api.access`,
:mod:`halfserve.api.admin`, the gRPC service) raises a :class:`RefusedError`, which carries a
:class:`~halfserve.api.dataplane.refusals.Refusal`: HTTP answers it with the refusal's status (:data:`STATUSES`, here)
and gRPC with its code (:data:`halfserve.api.grpc.grpc_service.CODES`). An HTTP route may raise an :class:`APIError`
with a status of HTTP's own (415, 409). The data plane's domain errors map onto a refusal too (:func:`from_exception`).

Neither FastAPI nor grpc: each transport's answers are its own (:mod:`halfserve.api.http.errors`,
:mod:`halfserve.api.grpc.grpc_service`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from halfserve.api.dataplane.refusals import Refusal, refused


class APIError(Exception):
    """An error to answer on HTTP with ``status``, ``headers`` and ``{"error": message}``: raised with a status of its
    own by the HTTP routes only (:mod:`halfserve.api.http`); elsewhere as a :class:`RefusedError`."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers


STATUSES: dict[Refusal, int] = {
    Refusal.INVALID: 400,
    Refusal.UNAUTHENTICATED: 401,
    Refusal.FORBIDDEN: 403,
    Refusal.NOT_FOUND: 404,
    Refusal.TOO_SLOW: 408,
    Refusal.TOO_LARGE: 413,
    Refusal.TOO_MANY: 429,
    Refusal.UNAVAILABLE: 503,
    Refusal.TIMED_OUT: 504,
    Refusal.NO_ROOM: 507,
    Refusal.FAILED: 500,
}
"""The HTTP status of each refusal."""


def _headers(retry_after: str | None, challenge: str | None) -> dict[str, str] | None:
    headers: dict[str, str] = {}
    if retry_after is not None:
        headers["Retry-After"] = retry_after
    if challenge is not None:
        headers["WWW-Authenticate"] = challenge
    return headers or None


class RefusedError(APIError):
    """A refusal of a kind every transport answers with its own status or code, and ``message``.

    ``retry_after``: the seconds after which sending the request again may succeed; ``challenge``: the authentication
    scheme a refused management call should use (HTTP answers them as ``Retry-After`` and ``WWW-Authenticate``)."""

    def __init__(
        self, refusal: Refusal, message: str, retry_after: str | None = None, challenge: str | None = None
    ) -> None:
        super().__init__(STATUSES[refusal], message, _headers(retry_after, challenge))
        self.refusal = refusal


class HeldError(RefusedError):
    """A refusal whose answer waits until ``hold`` returns, on whichever protocol answers it: a wrong admin token past
    the lockout's limit (:class:`~halfserve.api.lockout.Tarpit`)."""

    def __init__(self, refusal: Refusal, message: str, retry_after: str, hold: Callable[[], Awaitable[None]]) -> None:
        super().__init__(refusal, message, retry_after)
        self.hold = hold


async def held(e: BaseException) -> None:
    """Wait as long as ``e`` asks before it is answered (at once for any error but a :class:`HeldError`)."""
    if isinstance(e, HeldError):
        await e.hold()


def forget(e: BaseException) -> None:
    """Drop the tracebacks of ``e`` and of the errors it was raised from, once it is answered. Each holds the frames it
    passed through, and they the request's payload (a refused photo's bytes, a handler's payloads); where one of those
    frames holds the error in turn (an awaited future that failed with it), they make a cycle that only a collection of
    the garbage collector's older generations frees, seldom on a busy server. Kept, every refused photo had grown
    the server by its size (2.6 GB after 36 requests of 46 MB of refused photos)."""
    todo, seen = [e], set()
    while todo:
        err = todo.pop()
        if id(err) in seen:
            continue
        seen.add(id(err))
        err.__traceback__ = None
        todo.extend(x for x in (err.__cause__, err.__context__) if x is not None)


def from_exception(e: Exception) -> APIError:
    """``e`` when it is an :class:`APIError`, else the refusal an error raised below the routes
    (:mod:`halfserve.errors`'s domain errors) means."""
    if isinstance(e, APIError):
        return e
    answer = refused(e)
    return RefusedError(answer.refusal, answer.message, str(answer.retry_after) if answer.retry else None)
