"""Transports that write once per event-loop iteration, and the HTTP protocol the server runs over one.

Writes come in bursts: uvicorn writes a response's status line and headers, then its body; the backplane answers
every request of a batch in the same iteration. Each write is a system call and, on the other end, a wake-up of the
reader. :class:`CoalescedWrites` holds a connection's writes during one iteration and sends them together at its
end, as one ``writev``.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


class CoalescedWrites:
    """A transport whose writes during one event-loop iteration go out as one; anything else goes to ``transport``."""

    def __init__(self, transport: asyncio.BaseTransport) -> None:
        self._transport: Any = transport
        self._parts: list[bytes | memoryview] = []

    def write(self, data: bytes | memoryview) -> None:
        self.writelines([data])

    def writelines(self, parts: list[bytes | memoryview]) -> None:
        if not self._parts:
            asyncio.get_running_loop().call_soon(self.flush)
        self._parts += parts

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
    """uvicorn's httptools protocol over :class:`CoalescedWrites`: a response's head and body in one write."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(CoalescedWrites(transport))  # type: ignore[arg-type]
