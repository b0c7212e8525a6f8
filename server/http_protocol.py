"""The HTTP/1.1 protocol uvicorn runs for the server: httptools', with each response written in one piece.

uvicorn writes a response's status line and headers, then its body, as two writes to the socket: two system calls,
and on a keep-alive connection two wake-ups of the client, for every response. :class:`CoalescedWrites` holds the
writes a connection makes in one event-loop iteration and sends them together at its end.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


class CoalescedWrites:
    """A transport whose writes during one event-loop iteration go out as one; anything else goes to ``transport``."""

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self._parts: list[bytes] = []

    def write(self, data: bytes) -> None:
        if not self._parts:
            asyncio.get_running_loop().call_soon(self.flush)
        self._parts.append(data)

    def flush(self) -> None:
        if not self._parts:
            return
        parts, self._parts = self._parts, []
        if not self._transport.is_closing():
            self._transport.writelines(parts)  # one writev under uvloop, one sendmsg under asyncio: no joined copy

    def close(self) -> None:
        self.flush()  # what was written before the close goes first, as it would have
        self._transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class CoalescingHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol over :class:`CoalescedWrites`."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(CoalescedWrites(transport))  # type: ignore[arg-type]
