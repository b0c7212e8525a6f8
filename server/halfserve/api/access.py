"""What both transports check before they serve: the admin token (with its lockout, :mod:`halfserve.api.lockout`),
the shared memory regions that token opens, a model's version, the server's readiness.

Each takes what it needs from the call (its address, its ``authorization``) rather than a transport's request, so
HTTP (:mod:`halfserve.api.http.deps`) and gRPC (:mod:`halfserve.api.grpc.grpc_service`) ask the same questions.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import math
import secrets
from typing import TypeVar

from halfserve.api import lockout
from halfserve.api.dataplane.refusals import Refusal
from halfserve.api.errors import HeldError, RefusedError
from halfserve.serving import (
    UNKNOWN_MODEL,
    AppState,
    LocalModel,
    ModelHandle,
    ModelState,
    SharedRegions,
    not_serving,
    shown,
    why_model_not_ready,
)

log = logging.getLogger(__name__)

H = TypeVar("H", ModelHandle, LocalModel)


def of_version(served: H, version: str | None) -> H:
    """``served`` when ``version`` (None or empty: any) is the version it serves, else refused as not found."""
    if version and version != str(served.version):
        asked = version if version.isdigit() and len(version) <= 20 else shown(version)  # else quoted, and cut
        raise RefusedError(
            Refusal.NOT_FOUND,
            f"{UNKNOWN_MODEL}{served.name!r} version {asked} is not found (it serves version {served.version})",
        )
    return served


def check_taken(served: ModelHandle) -> None:
    """Refuse a request to ``served`` where it is unloaded or failed (:func:`~halfserve.serving.not_serving`'s 503)
    before its body is judged: a body checked against the manifest of a version no longer served (one that takes no
    images), decoded or handed to its handler (built again for it, where the build is what failed) would answer the
    client's mistake, or the handler's, for a model that serves nothing. A loading model is left to its queue, which
    waits for it or refuses in the same words."""
    if served.state in (ModelState.UNLOADED, ModelState.FAILED):
        raise not_serving(served)


def why_not_ready(s: AppState) -> str | None:
    """Why the server is not ready to take requests (draining, a model not ready, a front-end missing); None when it
    is."""
    if s.draining:
        return "the server is shutting down"
    if not s.service.ready:
        models = s.service.models.items()
        waiting = ", ".join(f"{n} ({why})" for n, m in models if (why := why_model_not_ready(m)) is not None)
        return waiting or "no model is served"
    for check in s.pending:
        missing = check()
        if missing:
            return missing
    return None


def check_admin(app: AppState, who: str, authorization: str) -> None:
    """The admin check (:func:`~halfserve.api.http.deps.require_admin`) for a call from address ``who`` carrying
    ``authorization`` (``Bearer <token>``), over whichever protocol. The right token is accepted whatever the failures
    before it, unless ``who`` itself has a full tarpit of wrong ones waiting
    (:meth:`~halfserve.api.lockout.Tarpit.full`)."""
    settings = app.settings
    if settings.admin_token is None:
        raise RefusedError(Refusal.FORBIDDEN, "management API is disabled; set HALFSERVE_ADMIN_TOKEN")
    pit = lockout.tarpit(app)
    if pit.full(who):  # refused whatever the token: an answer that depended on it would be a guess's verdict
        seconds = str(pit.retry_after())
        message = f"{pit.queue} wrong admin tokens from {who} are waiting for their answers; retry in {seconds} s"
        raise RefusedError(Refusal.TOO_MANY, message, retry_after=seconds)
    scheme, _, given = authorization.partition(" ")
    if scheme.lower() != "bearer" or not given.strip():
        message = "management call needs Authorization: Bearer <admin token>"
        raise RefusedError(Refusal.UNAUTHENTICATED, message, challenge="Bearer")
    # Digests of both, compared in constant time: neither the token's bytes nor its length show in the timing.
    expected = hashlib.sha256(settings.admin_token.get_secret_value().encode()).digest()
    if secrets.compare_digest(hashlib.sha256(given.strip().encode()).digest(), expected):
        return
    attempts = lockout.attempts(app)
    wait = attempts.retry_after(who)
    attempts.failed(who)
    if wait > 0:
        seconds = str(math.ceil(wait))
        source = "every address" if attempts.retry_after_all() > 0 else who
        message = f"too many wrong admin tokens from {source}; retry in {seconds} s"
        raise HeldError(Refusal.TOO_MANY, message, seconds, functools.partial(pit.hold, who))
    if attempts.retry_after(who) > 0:
        log.warning(
            "admin token: too many wrong tokens lately (the last from %s); further wrong ones are answered 429", who
        )
    raise RefusedError(Refusal.UNAUTHENTICATED, "wrong admin token", challenge='Bearer error="invalid_token"')


def admitted_regions(app: AppState, who: str, authorization: str) -> SharedRegions:
    """The regions a call from ``who`` carrying ``authorization`` may name, over whichever protocol
    (:func:`~halfserve.api.http.shm.authorised_regions`)."""
    try:
        check_admin(app, who, authorization)
    except RefusedError as e:  # reworded in place: a held answer (the lockout's tarpit) stays held
        e.message = f"shared_memory_region: using a shared memory region needs the admin token: {e.message}"
        raise
    return app.regions
