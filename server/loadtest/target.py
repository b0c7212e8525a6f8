"""Where load may go: this machine only, unless the user says otherwise."""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

from server.loadtest import LoadtestError

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
