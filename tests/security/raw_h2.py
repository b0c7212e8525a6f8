"""A bare HTTP/2 client over a socket, for the gRPC abuse tests: gRPC's own clients never leave a message
unfinished, open a stream and stay silent, or declare a length they do not send, which is what those tests need.

Only what the tests use: the connection preface, SETTINGS (acknowledged), HEADERS as literals without Huffman coding,
DATA, and a reader that records how each stream ended (trailers, ``RST_STREAM``) and whether the server sent
``GOAWAY`` or closed. The server's header blocks are not decoded.
"""

from __future__ import annotations

import socket
import struct
import time
from dataclasses import dataclass, field

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY, WINDOW_UPDATE = 0, 1, 3, 4, 6, 7, 8
END_STREAM, END_HEADERS, ACK = 0x1, 0x4, 0x1


def _frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream) + payload


def _int(value: int, prefix_bits: int, first: int = 0) -> bytes:
    """HPACK's integer encoding: ``value`` in a ``prefix_bits`` prefix, continued in 7-bit groups."""
    top = (1 << prefix_bits) - 1
    if value < top:
        return bytes([first | value])
    out = bytearray([first | top])
    value -= top
    while value >= 128:
        out.append(value % 128 + 128)
        value //= 128
    out.append(value)
    return bytes(out)


def _literal(name: str, value: str) -> bytes:
    """A header as a literal without indexing, neither string Huffman-coded."""
    n, v = name.encode(), value.encode()
    return b"\x00" + _int(len(n), 7) + n + _int(len(v), 7) + v


def grpc_message(body: bytes, declared: int | None = None, compressed: bool = False) -> bytes:
    """gRPC's length-prefixed message: ``body``, declared as ``declared`` bytes long (default: its own length)."""
    return bytes([int(compressed)]) + struct.pack(">I", len(body) if declared is None else declared) + body


@dataclass
class Connection:
    """One HTTP/2 connection to a gRPC server."""

    host: str
    port: int
    sock: socket.socket = field(init=False)
    next_stream: int = field(default=1, init=False)
    ended: dict[int, str] = field(default_factory=dict, init=False)
    """How each stream ended: ``"trailers"`` or ``"reset"``."""
    goaway: bool = field(default=False, init=False)
    closed: bool = field(default=False, init=False)
    window: int = field(default=65535, init=False)
    """What the server's connection window lets this side send (WINDOW_UPDATEs for stream 0 added)."""
    stream_windows: dict[int, int] = field(default_factory=dict, init=False)
    initial_window: int = field(default=65535, init=False)
    max_streams: int | None = field(default=None, init=False)
    _buffer: bytes = field(default=b"", init=False)

    def __post_init__(self) -> None:
        self.sock = socket.create_connection((self.host, self.port), timeout=10)
        self.sock.sendall(PREFACE + _frame(SETTINGS, 0, 0, b""))

    @classmethod
    def to(cls, address: str) -> Connection:
        host, port = address.rsplit(":", 1)
        return cls(host, int(port))

    def open(self, path: str, *, end: bool = False, extra: dict[str, str] | None = None) -> int:
        """A new stream's request headers for ``path`` (``/inference.GRPCInferenceService/ModelInfer``)."""
        stream = self.next_stream
        self.next_stream += 2
        headers = {
            ":method": "POST",
            ":scheme": "http",
            ":path": path,
            ":authority": f"{self.host}:{self.port}",
            "content-type": "application/grpc",
            "te": "trailers",
            **(extra or {}),
        }
        block = b"".join(_literal(k, v) for k, v in headers.items())
        self.sock.sendall(_frame(HEADERS, END_HEADERS | (END_STREAM if end else 0), stream, block))
        self.stream_windows[stream] = self.initial_window
        return stream

    def send(self, stream: int, data: bytes, *, end: bool = False, chunk: int = 16384) -> int:
        """Send as much of ``data`` as flow control allows now (reading the server's window updates as they come,
        for up to a few seconds); the number of bytes sent."""
        sent = 0
        deadline = time.monotonic() + 5
        while sent < len(data):
            room = min(self.window, self.stream_windows.get(stream, 0), chunk, len(data) - sent)
            if room <= 0:
                if time.monotonic() > deadline or self.closed or stream in self.ended:
                    break
                self.read(0.2)
                continue
            last = end and sent + room == len(data)
            try:
                self.sock.sendall(_frame(DATA, END_STREAM if last else 0, stream, data[sent : sent + room]))
            except OSError:
                self.closed = True
                break
            sent += room
            self.window -= room
            self.stream_windows[stream] -= room
        if end and not data:
            self.sock.sendall(_frame(DATA, END_STREAM, stream, b""))
        return sent

    def read(self, seconds: float) -> None:
        """Read and record frames for ``seconds`` (or until the server closes)."""
        deadline = time.monotonic() + seconds
        while not self.closed:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self.sock.settimeout(left)
            try:
                chunk = self.sock.recv(65536)
            except TimeoutError:
                return
            except OSError:
                self.closed = True
                return
            if not chunk:
                self.closed = True
                return
            self._buffer += chunk
            self._parse()

    def wait(self, condition: object, seconds: float) -> bool:
        """Read until ``condition()`` holds or ``seconds`` pass; whether it held."""
        deadline = time.monotonic() + seconds
        while not condition():  # type: ignore[operator]
            if time.monotonic() > deadline or self.closed:
                return bool(condition())  # type: ignore[operator]
            self.read(0.1)
        return True

    def _parse(self) -> None:
        while len(self._buffer) >= 9:
            length = int.from_bytes(self._buffer[:3], "big")
            if len(self._buffer) < 9 + length:
                return
            kind, flags = self._buffer[3], self._buffer[4]
            stream = int.from_bytes(self._buffer[5:9], "big") & 0x7FFFFFFF
            payload = self._buffer[9 : 9 + length]
            self._buffer = self._buffer[9 + length :]
            if kind == SETTINGS and not flags & ACK:
                for i in range(0, len(payload), 6):
                    key, value = struct.unpack(">HI", payload[i : i + 6])
                    if key == 3:
                        self.max_streams = value
                    elif key == 4:
                        for s in self.stream_windows:
                            self.stream_windows[s] += value - self.initial_window
                        self.initial_window = value
                self.sock.sendall(_frame(SETTINGS, ACK, 0, b""))
            elif kind == PING and not flags & ACK:
                self.sock.sendall(_frame(PING, ACK, 0, payload))
            elif kind == WINDOW_UPDATE:
                increment = int.from_bytes(payload[:4], "big") & 0x7FFFFFFF
                if stream == 0:
                    self.window += increment
                else:
                    self.stream_windows[stream] = self.stream_windows.get(stream, 0) + increment
            elif kind == HEADERS and flags & END_STREAM:
                self.ended.setdefault(stream, "trailers")
            elif kind == RST_STREAM:
                self.ended.setdefault(stream, "reset")
            elif kind == GOAWAY:
                self.goaway = True

    def close(self) -> None:
        self.sock.close()
