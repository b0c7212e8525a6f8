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
* **``Host``**: a name that is not an IP address, ``localhost`` (or a ``.localhost`` name), the name the server binds
  to or one of ``allowed_hosts`` is a 400, so a rebound name reads nothing: the browser sends the attacker's name, and
  an address cannot be rebound. ``allowed_hosts = *`` answers any. Health and readiness probes are exempt. On every
  route, the probes included, a request with more than one ``Host``, an HTTP/1.1 request with none, and a ``Host``
  that is no host and port (``127.0.0.1:99999``) are a 400 (RFC 9112 section 3.2). A request whose target is in
  absolute form (``GET http://name/path``) is judged by the target's name, which stands in for its ``Host`` (RFC 9112
  section 3.2.2; the HTTP protocol, :mod:`halfserve.httpprotocol`, puts it there).

With ``--http-workers`` these checks run once, in the front-end that took the request, on what the client sent.
"""

from __future__ import annotations

import functools
import ipaddress
import re
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from starlette.types import Receive, Scope, Send

from halfserve.api.errors import APIError
from halfserve.api.http.errors import error_response
from halfserve.api.http.limits import scope_header
from halfserve.transport import PROBE_PATHS

if TYPE_CHECKING:
    from halfserve.settings import Settings

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
LONGEST_HOST = 300
"""Longest ``Host`` worth checking: a DNS name is at most 253 characters, and a port adds six."""
_HOST_SYNTAX = re.compile(rb"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._~!$&'()*+,;=%-]*)(:[0-9]{0,5})?")
"""RFC 9110 section 7.2's ``uri-host [ ":" port ]``: an IPv6 address in brackets or a name of the URI's characters,
and a port of digits (checked for 65535 apart)."""
JSON = ("application/json",)
JSON_OR_BINARY = ("application/json", "application/octet-stream")


def check(scope: Scope, settings: Settings) -> None:
    """Fail with 400 for a Host this server does not answer to (:func:`host_allowed`), 403 for a browser's
    cross-origin request that could change or run something."""
    if sum(1 for key, _ in scope["headers"] if key == b"host") > 1:
        # RFC 9112 section 3.2: which one a proxy in front acted on is unknown, so neither is trusted.
        raise APIError(400, "Host: more than one Host header; send one")
    if scope.get("client") is None:
        # Relayed by an --http-workers front-end over the engine process's Unix socket (the only way in without a
        # client address): the front-end ran this check on what the client sent, Host or none; the Host here is
        # the relay's own.
        return
    raw = scope_header(scope, b"host")
    problem = host_problem(raw, scope.get("http_version", "1.1"))
    if problem is not None:
        raise APIError(400, problem)
    # The probes are answered whatever the Host: a Kubernetes probe addresses the pod by its IP, and they disclose
    # nothing.
    if scope["path"] not in PROBE_PATHS and not host_allowed(raw, tuple(settings.allowed_hosts), settings.host):
        raise APIError(400, f"Host: {host_name(raw)[:200]!r} is not a name this server answers to (allowed_hosts)")
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


async def admitted(scope: Scope, receive: Receive, send: Send, settings: Settings) -> bool:
    """:func:`check` a request; when it fails, answer it with the error and return False."""
    try:
        check(scope, settings)
    except APIError as e:
        await error_response(e.status, e.message, e.headers)(scope, receive, send)
        return False
    return True


@functools.lru_cache(maxsize=256)
def host_problem(raw: bytes | None, http_version: str) -> str | None:
    """What is wrong with a request's ``Host`` (``raw``, None when it sent none) whatever the server's name: an
    HTTP/1.1 request without one, or one that is no host and optional port (RFC 9112 section 3.2: a server MUST answer
    400 to either); None when nothing is. HTTP/1.0 needs none. Cached as :func:`_host_allowed` is."""
    if raw is None:
        return (
            None if http_version == "1.0" else "Host: missing; an HTTP/1.1 request must send one (RFC 9112 section 3.2)"
        )
    if len(raw) > LONGEST_HOST:
        return f"Host: {len(raw)} bytes, more than a name and port take ({LONGEST_HOST})"
    found = _HOST_SYNTAX.fullmatch(raw)
    if found is None:
        return f"Host: {raw.decode('latin-1')!r} is not a host and optional port"
    port = found.group(2)
    if port is not None and len(port) > 1 and int(port[1:]) > 65535:
        return f"Host: {raw.decode('latin-1')!r} names port {int(port[1:])}, past 65535"
    return None


def host_allowed(raw: bytes | None, allowed_hosts: tuple[str, ...], bound: str) -> bool:
    """Whether this server answers a request whose ``Host`` header is ``raw``: an IP address, ``localhost`` or a
    ``.localhost`` name (resolved to the loopback by browsers themselves), ``bound`` (the address or name the server
    listens on), or a name one of ``allowed_hosts`` matches (``*`` matches any). None of these can be a name an
    attacker rebinds to this server's address. A request without a Host (HTTP/1.0) is not a browser's: answered."""
    if raw is None or "*" in allowed_hosts:
        return True
    if len(raw) > LONGEST_HOST:
        return False
    return _host_allowed(raw, allowed_hosts, bound)


@functools.lru_cache(maxsize=256)
def _host_allowed(raw: bytes, allowed_hosts: tuple[str, ...], bound: str) -> bool:
    # Cached: a server sees the same few Hosts, and checking one costs a few microseconds it need not pay again.
    host = host_name(raw).removesuffix(".")  # a fully qualified name's root dot: the same name
    if host in ("localhost", bound.lower()) or host.endswith(".localhost"):
        return True
    try:
        ipaddress.ip_address(host[1:-1] if host.startswith("[") else host)
    except ValueError:
        return any(_matches(host, pattern) for pattern in allowed_hosts)
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
