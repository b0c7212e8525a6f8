"""Frames on a stream socket: what every channel between the server's processes carries.

A frame is ``<II`` (header length, payload length), an orjson header (a JSON object), then the payload. Both ends
of both process families speak it: a front-end and the engine process (:mod:`halfserve.multiproc`), the server
process and its instance processes (:mod:`halfserve.isolated`).
"""

from __future__ import annotations

import struct
from typing import Any

import orjson

FRAME = struct.Struct("<II")
"""A frame's prefix: header length, payload length (bytes)."""

Header = dict[str, Any]
"""A frame's header, as decoded."""
Frame = tuple[Header, bytearray]
"""A frame as received: its header and its payload (arrays may be views of it)."""


class FrameError(ValueError):
    """A frame that is not one: a header that is no JSON object, or a stream that ended inside a frame."""


def frame(header: Header, *payload: bytes | memoryview) -> list[bytes | memoryview]:
    """The buffers of one frame, for ``transport.writelines``; the payload may come in parts."""
    head = orjson.dumps(header)
    parts: list[bytes | memoryview] = [FRAME.pack(len(head), sum(len(p) for p in payload)), head]
    parts.extend(p for p in payload if len(p))
    return parts


class FrameReader:
    """Cuts a byte stream into (header, payload) frames."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[Frame]:
        """The frames ``data`` completes, in order; raises :class:`FrameError` at a header that is no JSON object
        (the stream cannot be trusted past it)."""
        self._buf += data
        out: list[Frame] = []
        buf, pos = self._buf, 0
        while len(buf) - pos >= FRAME.size:
            head_len, payload_len = FRAME.unpack_from(buf, pos)
            end = pos + FRAME.size + head_len + payload_len
            if len(buf) < end:
                break
            start = pos + FRAME.size
            out.append((_header(memoryview(buf)[start : start + head_len]), buf[start + head_len : end]))
            pos = end
        if pos:
            del buf[:pos]
        return out

    def end(self) -> None:
        """The stream ended: raises :class:`FrameError` when it ended inside a frame."""
        if self._buf:
            size = len(self._buf)
            if size < FRAME.size:
                raise FrameError(f"the stream ended inside a frame's {FRAME.size}-byte prefix ({size} bytes of it)")
            head_len, payload_len = FRAME.unpack_from(self._buf)
            raise FrameError(
                f"the stream ended inside a frame: {size} of its {FRAME.size + head_len + payload_len} bytes came"
            )


def _header(data: memoryview) -> Header:
    try:
        header = orjson.loads(data)
    except orjson.JSONDecodeError as e:
        raise FrameError(f"a frame's header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise FrameError(f"a frame's header is a JSON {type(header).__name__}, not an object")
    return header
