"""The refusals, each mapped once per transport: an HTTP status (``halfserve.api.errors``) and a gRPC code
(``halfserve.api.grpc.grpc_service``), as clients have seen them; and no HTTP status raised outside the HTTP routes."""

from __future__ import annotations

import ast
from pathlib import Path

import grpc
import pytest

from halfserve.api.dataplane.refusals import Refusal, cut_off_by_shutdown, refused
from halfserve.api.errors import STATUSES, HeldError, RefusedError, from_exception
from halfserve.api.grpc.grpc_service import CODES, _refusal
from halfserve.errors import (
    BatchFailedError,
    DeadlineExceededError,
    IdOutOfRangeError,
    InternalError,
    InvalidInputError,
    ModelNotReadyError,
    ModelUnavailableError,
    OverLimitError,
    QueueFullError,
    RegionFullError,
    RequestTooLargeError,
    ServingError,
    error_from_wire,
    error_to_wire,
)

ANSWERS = [
    (Refusal.INVALID, 400, grpc.StatusCode.INVALID_ARGUMENT),
    (Refusal.UNAUTHENTICATED, 401, grpc.StatusCode.UNAUTHENTICATED),
    (Refusal.FORBIDDEN, 403, grpc.StatusCode.PERMISSION_DENIED),
    (Refusal.NOT_FOUND, 404, grpc.StatusCode.NOT_FOUND),
    (Refusal.TOO_SLOW, 408, grpc.StatusCode.DEADLINE_EXCEEDED),
    (Refusal.TOO_LARGE, 413, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (Refusal.TOO_MANY, 429, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (Refusal.FAILED, 500, grpc.StatusCode.INTERNAL),
    (Refusal.UNAVAILABLE, 503, grpc.StatusCode.UNAVAILABLE),
    (Refusal.TIMED_OUT, 504, grpc.StatusCode.DEADLINE_EXCEEDED),
    (Refusal.NO_ROOM, 507, grpc.StatusCode.RESOURCE_EXHAUSTED),
]
"""Each refusal's HTTP status and gRPC code, as clients get them."""

CODE_OF = {status: code for _, status, code in ANSWERS}


def test_each_refusal_has_one_status_and_one_code() -> None:
    assert [refusal for refusal, _, _ in ANSWERS] == sorted(Refusal, key=STATUSES.__getitem__)
    assert len(set(STATUSES.values())) == len(Refusal)  # a status names one refusal


@pytest.mark.parametrize(("refusal", "status", "code"), ANSWERS, ids=[r.value for r, _, _ in ANSWERS])
def test_a_refusal_is_answered_with_its_status_and_its_code(
    refusal: Refusal, status: int, code: grpc.StatusCode
) -> None:
    assert (STATUSES[refusal], CODES[refusal]) == (status, code)
    error = RefusedError(refusal, "why")
    assert (error.status, error.message, error.headers) == (status, "why", None)
    assert _refusal(error) == (code, "why")


async def _at_once() -> None:
    return None


@pytest.mark.parametrize(
    ("error", "headers"),
    [
        (RefusedError(Refusal.TOO_MANY, "busy", retry_after="3"), {"Retry-After": "3"}),
        (RefusedError(Refusal.UNAUTHENTICATED, "no token", challenge="Bearer"), {"WWW-Authenticate": "Bearer"}),
        (HeldError(Refusal.TOO_MANY, "wait", "2", _at_once), {"Retry-After": "2"}),
    ],
)
def test_a_refusal_s_retry_and_challenge_are_http_headers(error: RefusedError, headers: dict[str, str]) -> None:
    assert from_exception(error) is error
    assert error.headers == headers
    assert _refusal(error) == (CODES[error.refusal], error.message)


PACKAGE = Path(__file__).resolve().parents[2] / "server" / "halfserve"
"""Modules outside the HTTP routes that still give an error an HTTP status."""


def test_no_error_outside_the_http_routes_is_given_an_http_status() -> None:
    """Code that gRPC runs, or both transports, refuses with a :class:`Refusal`: an error built with a number is an
    HTTP route's own (``halfserve.api.http``)."""
    given = []
    for path in sorted(PACKAGE.rglob("*.py")):
        where = path.relative_to(PACKAGE).as_posix()
        if where.startswith("api/http/"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call) or not node.args:
                continue
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            first = node.args[0]
            if name.endswith("Error") and isinstance(first, ast.Constant) and type(first.value) is int:
                given.append(f"{where}:{node.lineno}: {name}({first.value}, ...)")
    assert not given, given


@pytest.mark.parametrize(
    ("error", "status", "message", "retry"),
    [
        (InvalidInputError("x: bad"), 400, "x: bad", False),
        (OverLimitError("x: 9 rows exceed"), 413, "x: 9 rows exceed", False),
        (RequestTooLargeError("9 rows"), 413, "inputs: 9 rows", False),
        (ModelUnavailableError("m is gone"), 404, "m is gone", False),
        (ModelNotReadyError("loading"), 503, "loading", True),
        (ModelNotReadyError("no text now", retry=False), 503, "no text now", False),
        (QueueFullError("queue full"), 503, "queue full", True),
        (cut_off_by_shutdown(), 503, str(cut_off_by_shutdown()), True),
        (DeadlineExceededError("late"), 504, "late", False),
        (RegionFullError("ENOSPC"), 507, "ENOSPC", False),
        (BatchFailedError("boom"), 500, "inference failed: boom", False),
        (InternalError("KeyError: 'x'"), 500, "internal error: KeyError: 'x'", False),
        (KeyError("x"), 500, "internal error: KeyError: 'x'", False),
    ],
)
def test_a_domain_error_is_answered_alike_on_both_transports(
    error: Exception, status: int, message: str, retry: bool
) -> None:
    http = from_exception(error)
    assert (http.status, http.message) == (status, message)
    assert (http.headers is not None) == retry
    assert refused(error).retry == retry
    assert _refusal(error) == (CODE_OF[status], message)


def test_a_model_not_ready_says_when_to_retry_across_a_process_and_in_retry_after() -> None:
    # An engine whose every instance process waits out a 30 s back-off; a front-end process answers the client.
    carried = error_from_wire(error_to_wire(ModelNotReadyError("restarting", retry_after=30)))
    assert isinstance(carried, ModelNotReadyError)
    assert carried.retry_after == 30
    assert from_exception(carried).headers == {"Retry-After": "30"}
    assert from_exception(ModelNotReadyError("loading")).headers == {"Retry-After": "1"}
    assert from_exception(ModelNotReadyError("no text", retry=False, retry_after=30)).headers is None


def _kinds(cls: type[ServingError]) -> list[type[ServingError]]:
    return [k for sub in cls.__subclasses__() for k in (sub, *_kinds(sub))]


@pytest.mark.parametrize(
    "kind", [k for k in _kinds(ServingError) if k is not IdOutOfRangeError], ids=lambda k: k.__name__
)
def test_every_domain_error_crosses_a_process_as_itself(kind: type[ServingError]) -> None:
    """A front-end process answers what the engine process refused as one process would: a kind missing from the wire
    would reach the client as a 500 internal error (a 413 over a limit, a handler's time limit, had either been
    raised in the engine process)."""
    carried = error_from_wire(error_to_wire(kind("why")))
    assert type(carried) is kind
    assert str(carried) == "why"
    assert from_exception(carried).status == from_exception(kind("why")).status


def test_a_token_id_out_of_range_keeps_its_row_across_a_process() -> None:
    """A front-end process answers a V1 request whose ids the engine process refused: it names the instance."""
    carried = error_from_wire(error_to_wire(IdOutOfRangeError("tokens", 1, 100_000, 50)))
    assert isinstance(carried, IdOutOfRangeError)
    assert (
        str(carried)
        == "inputs: input 'tokens' row 1 holds 100000, outside 0..49: the ids the model's embedding of 50 rows takes"
    )
    assert str(carried.in_rows("instances")) == (
        "instances[1]: input 'tokens' holds 100000, outside 0..49: the ids the model's embedding of 50 rows takes"
    )
    assert from_exception(carried).status == 400
