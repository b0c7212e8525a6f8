"""A request's head, as the HTTP protocol (:mod:`halfserve.httpprotocol`) reads it before any route sees it: an
absolute-form target's host standing in for ``Host``, the path a route answered straight from the protocol is matched
on, whether a request is a health or readiness probe, and whether its body's framing is one the server reads as the
client meant it."""

from __future__ import annotations

import re
import urllib.parse

from halfserve.transport import PROBE_PATHS

_SCHEME = re.compile(rb"[A-Za-z][A-Za-z0-9+.-]*")
"""RFC 3986 section 3.1's ``scheme``: what comes before ``://`` in a request target in absolute form."""


class NoHost(ValueError):
    """An ``http`` or ``https`` target in absolute form that names no host; its message is the 400's."""


def absolute_form(url: bytes) -> tuple[bytes, bytes] | None:
    """For a request target in absolute form (``http://name/path``, any scheme), its authority (the name and port
    that stand in for every ``Host`` the request sent, RFC 9112 section 3.2.2) and its path and query (``/`` for an
    empty path, RFC 9110 section 4.2.3); None for origin-form (``/a://b`` has no scheme) or asterisk-form. An ``http``
    or ``https`` target that names no host raises :class:`NoHost` (RFC 9110 section 4.2.1)."""
    if b"://" not in url:
        return None
    url = url.partition(b"#")[0]
    scheme, _, rest = url.partition(b"://")
    if _SCHEME.fullmatch(scheme) is None:
        return None
    end = min((i for i in (rest.find(b"/"), rest.find(b"?")) if i >= 0), default=len(rest))
    authority, target = rest[:end], rest[end:]
    if not authority and scheme.lower() in (b"http", b"https"):
        raise NoHost(f"request target: {url[:200].decode('latin-1')!r} names no host (RFC 9110 section 4.2.1)")
    return authority, target if target.startswith(b"/") else b"/" + target


def origin_path(url: bytes) -> tuple[str, bytes, bytes] | None:
    """An origin-form target's path (percent-decoded), raw path and query; None for a target uvicorn refuses, and
    answers (its parsing): one not starting with ``/`` or not ASCII."""
    url = url.partition(b"#")[0]
    if not url.startswith(b"/") or not url.isascii():
        return None
    raw_path, _, query = url.partition(b"?")
    path = raw_path.decode("ascii")
    return urllib.parse.unquote(path) if "%" in path else path, raw_path, query


def is_probe(method: bytes, url: bytes) -> bool:
    """Whether a request is a health or readiness probe (answered past the connection cap)."""
    if method not in (b"GET", b"HEAD"):
        return False
    return url.partition(b"?")[0].partition(b"#")[0].decode("latin-1") in PROBE_PATHS


def framing_problem(headers: list[tuple[bytes, bytes]], upgrade: bool) -> tuple[int, str] | None:
    """The status and words of a refusal for a head whose body the server would read otherwise than the client (or a
    proxy in front) meant, None for one it reads as meant (``headers`` as uvicorn keeps them, names lower case):

    - a transfer coding other than ``chunked`` alone, which the parser would ignore and read the body as plain chunks
      (``gzip, chunked`` as JSON): 501, as RFC 9112 section 6.1 asks;
    - a body on a request asking to upgrade (``Connection: upgrade``): the parser takes what follows the head as the
      new protocol's, so the body, and any request pipelined after it, would be lost.
    """
    for name, value in headers:
        if name == b"transfer-encoding" and value.strip().lower() != b"chunked":
            sent = value[:100].decode("latin-1")
            return 501, f"Transfer-Encoding: {sent!r} is not supported; send the body chunked alone or with a length"
    if upgrade and any(
        (name == b"content-length" and value.strip() != b"0") or name == b"transfer-encoding" for name, value in headers
    ):
        return 400, (
            "Upgrade: a request asking to upgrade cannot carry a body here (the server speaks HTTP/1.1 only); "
            "send it without Connection: upgrade"
        )
    return None
