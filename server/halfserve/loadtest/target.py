"""Where load may go: this machine only, unless the user says otherwise."""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

from halfserve.loadtest import LoadtestError

LOCAL_NAMES = frozenset({"localhost"})


def is_local_host(host: str) -> bool:
    """True for ``localhost`` and loopback addresses (127.0.0.0/8, ::1)."""
    host = host.lower().rstrip(".")
    if host in LOCAL_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_url(url: str, *, allow_remote: bool = False) -> str:
    """The server's base URL (scheme, host and port; no trailing slash) if load may be sent there.

    A load test is a flood of requests: it goes to this machine unless ``allow_remote`` is set, so that a typo or a
    pasted production URL cannot turn it on someone else's service.
    """
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https"):
        raise LoadtestError(f"--url {url!r}: expected http://HOST:PORT")
    host = parts.hostname
    if not host:
        raise LoadtestError(f"--url {url!r}: no host")
    try:
        port = parts.port
    except ValueError as e:
        raise LoadtestError(f"--url {url!r}: {e}") from None
    if parts.query or parts.fragment or parts.path not in ("", "/"):
        raise LoadtestError(f"--url {url!r}: give the server's base URL only (http://HOST:PORT), without a path")
    if not allow_remote and not is_local_host(host):
        raise LoadtestError(
            f"--url {url!r}: {host} is not this machine; load goes only to 127.0.0.1 or localhost "
            "(pass --allow-remote to load a server you are responsible for)"
        )
    netloc = f"[{host}]" if ":" in host else host
    if port is not None:
        netloc += f":{port}"
    return f"{parts.scheme}://{netloc}"


GRPC_PORT = 8001
"""The server's default gRPC port."""


def grpc_target(grpc_url: str | None, base_url: str, allow_remote: bool = False) -> str:
    """``host:port`` of the gRPC service to load: ``grpc_url`` (``HOST:PORT``), else the HTTP base URL's host on
    port 8001; held to this machine like :func:`check_url`."""
    if grpc_url is None:
        host = urlsplit(base_url).hostname or "127.0.0.1"
        grpc_url = f"[{host}]:{GRPC_PORT}" if ":" in host else f"{host}:{GRPC_PORT}"
    parts = urlsplit(f"http://{grpc_url.strip()}")
    try:
        port = parts.port
    except ValueError as e:
        raise LoadtestError(f"--grpc-url {grpc_url!r}: {e}") from None
    if not parts.hostname or port is None or parts.path or parts.query or parts.fragment:
        raise LoadtestError(f"--grpc-url {grpc_url!r}: expected HOST:PORT")
    base = check_url(f"http://{parts.netloc}", allow_remote=allow_remote)
    return base.removeprefix("http://")
