"""The data plane's refusals, each mapped once per transport: an HTTP status (``halfserve.api.errors``) and a gRPC
code (``halfserve.api.grpc.grpc_service``), agreeing with each other as clients have seen them."""

from __future__ import annotations

import pytest

from halfserve.api.dataplane.refusals import Refusal, cut_off_by_shutdown, refused
from halfserve.api.errors import STATUSES, from_exception
from halfserve.api.grpc.grpc_service import CODES, STATUS_CODES, _refusal
from halfserve.serving import (
    BatchFailedError,
    DeadlineExceededError,
    InternalError,
    InvalidInputError,
    ModelNotReadyError,
    ModelUnavailableError,
    OverLimitError,
    QueueFullError,
    RegionFullError,
    RequestTooLargeError,
)


@pytest.mark.parametrize("refusal", list(Refusal))
def test_each_refusal_has_one_status_and_one_code_that_agree(refusal: Refusal) -> None:
    assert CODES[refusal] == STATUS_CODES[STATUSES[refusal]]


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
    assert _refusal(error) == (STATUS_CODES[status], message)
