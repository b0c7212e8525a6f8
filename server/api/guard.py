"""What a request must show before any route sees it: a Host this server answers to, and, from a browser, that it
comes from this server's own pages. And what the inference routes accept as a body's ``Content-Type``.

A browser lets any web page send a "simple" POST (no custom headers, a ``text/plain`` or form body, or no
``Content-Type`` at all) to any address, the visitor's internal network included, without asking first. So a page could
make its visitors' browsers run inference on an internal server, and through DNS rebinding (a name of the attacker's
that comes to point at 127.0.0.1) read its listings and metrics. Three checks close that:

* **Cross-origin requests from browsers** are refused (403) on every method but GET, HEAD and OPTIONS: a browser says
  where a request comes from in ``Sec-Fetch-Site`` (every current browser), or at least in ``Origin``, which must
  then name this server's own host. Programs (tritonclient, curl, httpx, load tools) send neither and pass.
* **``Content-Type``** on the inference routes, when a request gives one, must be JSON (or ``application/octet-stream``
  for V2 binary and raw tensor data): 415 otherwise. A request without one is read as before, as tritonclient sends
  none.
* **``allowed_hosts``** (off by default): the ``Host`` header must name one of them (400 otherwise), so a rebound name
  reads nothing. Health and readiness probes, which address a pod by its IP, are exempt.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from starlette.types import Receive, Scope, Send

from server.api.errors import APIError, error_response
from server.api.limits import scope_header

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
PROBES = frozenset({"/health", "/ready", "/v2/health/live", "/v2/health/ready"})
"""Answered whatever the Host: a Kubernetes probe addresses the pod by its IP, and they disclose nothing."""
JSON = ("application/json",)
JSON_OR_BINARY = ("application/json", "application/octet-stream")


def check(scope: Scope, allowed_hosts: list[str]) -> None:
    """Fail with 400 for a Host outside ``allowed_hosts`` (when it is set), 403 for a browser's cross-origin request
    that could change or run something."""
    if allowed_hosts and scope["path"] not in PROBES:
        host = host_name(scope_header(scope, b"host"))
        if not any(_matches(host, pattern) for pattern in allowed_hosts):
            raise APIError(400, f"Host: {host!r} is not a name this server answers to (allowed_hosts)")
    if scope["method"] in SAFE_METHODS:
        return
    site = scope_header(scope, b"sec-fetch-site")
    if site is not None:
        if site in (b"same-origin", b"none"):  # the server's own pages, or the user typing or bookmarking the URL
            return
        raise APIError(403, f"Sec-Fetch-Site: a {site.decode('latin-1')} request from a browser is refused")
    origin = scope_header(scope, b"origin")
    if origin is None:
        return  # not a browser (or one too old to say): what a page could do with it, a client could do anyway
    own = (scope_header(scope, b"host") or b"").decode("latin-1").lower()
    if urlsplit(origin.decode("latin-1")).netloc.lower() != own:
        text = origin.decode("latin-1")[:200]
        raise APIError(403, f"Origin: a request from {text!r}, another site, is refused")


async def admitted(scope: Scope, receive: Receive, send: Send, allowed_hosts: list[str]) -> bool:
    """:func:`check` a request; when it fails, answer it with the error and return False."""
    try:
        check(scope, allowed_hosts)
    except APIError as e:
        await error_response(e.status, e.message, e.headers)(scope, receive, send)
        return False
    return True


def host_name(value: bytes | None) -> str:
    """The name in a ``Host`` header, lower case, without its port."""
    text = (value or b"").decode("latin-1").strip().lower()
    if text.startswith("["):  # an IPv6 address
        return text[: text.find("]") + 1] if "]" in text else text
    return text.rsplit(":", 1)[0] if ":" in text else text


def _matches(host: str, pattern: str) -> bool:
    pattern = pattern.lower()
    if pattern == "*":
        return True
    if pattern.startswith("*."):
        return host.endswith(pattern[1:])
    return host == pattern


def content_type(scope: Scope, accepted: tuple[str, ...]) -> None:
    """Fail with 415 when the request names a ``Content-Type`` that is not one of ``accepted`` (or a ``+json`` type
    where JSON is); a request that names none passes."""
    raw = scope_header(scope, b"content-type")
    if raw is None:
        return
    media = raw.decode("latin-1").split(";", 1)[0].strip().lower()
    if media in accepted or (media.endswith("+json") and "application/json" in accepted):
        return
    raise APIError(
        415,
        f"Content-Type: {raw.decode('latin-1')[:200]!r} is not accepted here; send {' or '.join(accepted)}",
    )
