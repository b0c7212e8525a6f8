"""A channel's blocking end: frames over a stream socket, for a process that has no event loop (an instance process).

The event-loop ends (a front-end, the engine process, the server process's side of an instance) are asyncio
protocols that feed a :class:`~halfserve.ipc.frames.FrameReader` and write :func:`~halfserve.ipc.frames.frame`'s
buffers; this end does the same with ``recv`` and ``sendall``.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator

from halfserve.ipc.frames import Frame, FrameReader, Header, frame

RECV_BYTES = 1 << 20
"""The most bytes one ``recv`` takes: a batch's frame is small, its rows lie in shared memory."""


class Channel:
    """Frames to and from the other end of ``sock``."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.reader = FrameReader()

    def send(self, header: Header, *payload: bytes | memoryview) -> None:
        self.sock.sendall(b"".join(frame(header, *payload)))

    def frames(self) -> Iterator[Frame]:
        """The frames received, in order, until the other end closes; raises
        :class:`~halfserve.ipc.frames.FrameError` when it closed inside a frame or sent one that is not."""
        while True:
            data = self.sock.recv(RECV_BYTES)
            if not data:
                self.reader.end()
                return
            yield from self.reader.feed(data)
