"""Coalesced writes: what a connection writes in one event-loop iteration goes out as one write."""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.server import ServerState

from halfserve.httpprotocol import HttpLimits, LimitedHttpProtocol
from halfserve.httpserver import uvicorn_config
from halfserve.ipc.frames import FrameReader, frame
from halfserve.settings import Settings
from halfserve.transport import CoalescedWrites, CoalescingHttpToolsProtocol
from tests.waiting import until


class RecordingTransport(asyncio.Transport):
    """Keeps each ``write`` and when ``close`` came."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[object] = []
        self.closing = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.events.append(bytes(data))

    def writelines(self, list_of_data: Any) -> None:
        self.events.append(b"".join(list_of_data))

    def close(self) -> None:
        self.events.append("close")
        self.closing = True

    def is_closing(self) -> bool:
        return self.closing

    def get_extra_info(self, name: str, default: object = None) -> object:
        return ("127.0.0.1", 1234) if name == "peername" else default


def test_writes_in_one_iteration_go_out_as_one_and_a_close_sends_them_first() -> None:
    async def scenario() -> list[list[object]]:
        transport = RecordingTransport()
        writes = CoalescedWrites(transport)
        writes.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n")
        writes.write(b"{}")
        seen = [list(transport.events)]  # nothing yet: the iteration is not over
        await asyncio.sleep(0)
        seen.append(list(transport.events))
        writes.write(b"last")
        writes.close()  # a connection closed after its response: the response first
        seen.append(list(transport.events))
        await asyncio.sleep(0)
        writes.write(b"too late")  # nothing reaches a closing transport
        await asyncio.sleep(0)
        seen.append(list(transport.events))
        assert writes.get_extra_info("peername") == ("127.0.0.1", 1234)  # the rest is the transport's
        return seen

    before, after_iteration, after_close, at_end = asyncio.run(scenario())
    assert before == []
    assert after_iteration == [b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}"]
    assert after_close == [*after_iteration, b"last", "close"]
    assert at_end == after_close


def test_the_server_runs_the_coalescing_protocol_with_the_settings_limits() -> None:
    settings = Settings(header_timeout=3, body_timeout=4, max_url_bytes=5000, max_header_bytes=6000, max_connections=7)
    config = uvicorn_config(lambda *_: None, settings, None, host="127.0.0.1", port=0)  # type: ignore[arg-type]
    assert isinstance(config.http, type)
    assert issubclass(config.http, CoalescingHttpToolsProtocol)
    assert issubclass(config.http, LimitedHttpProtocol)
    assert config.http.limits == HttpLimits(3, 4, 5000, 6000, 7)


def test_backplane_frames_sent_in_one_iteration_are_written_together_in_order() -> None:
    async def scenario() -> list[object]:
        transport = RecordingTransport()
        writes = CoalescedWrites(transport)
        for i in range(3):
            writes.writelines(frame({"id": i}, bytes([i])))
        await asyncio.sleep(0)
        return transport.events

    (burst,) = asyncio.run(scenario())
    assert isinstance(burst, bytes)
    assert [(h, bytes(p)) for h, p in FrameReader().feed(burst)] == [({"id": i}, bytes([i])) for i in range(3)]


class StuckTransport(RecordingTransport):
    """A socket whose client reads nothing: what is written stays in its buffer, and a close waits for it."""

    def get_write_buffer_size(self) -> int:
        return sum(len(e) for e in self.events if isinstance(e, bytes))

    def can_write_eof(self) -> bool:
        return True

    def abort(self) -> None:
        self.events.append("abort")
        self.closing = True


def test_a_closed_connection_whose_last_bytes_are_not_read_is_dropped_after_the_send_timeout() -> None:
    """Under the high-water mark no pause comes, so the close itself is bounded: else the socket, and its place
    under the connection cap, would wait for a client that never reads."""

    async def scenario() -> list[object]:
        config = uvicorn_config(lambda *_: None, Settings(send_timeout=0.01), None, host="127.0.0.1", port=0)  # type: ignore[arg-type]
        config.load()
        protocol = config.http(config=config, server_state=ServerState(), app_state={})  # type: ignore[operator]
        transport = StuckTransport()
        protocol.connection_made(transport)
        protocol.transport.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}")
        protocol.transport.close()  # as uvicorn closes an idle connection
        await until(lambda: "abort" in transport.events, "the stuck connection dropped")
        protocol.connection_lost(None)
        return transport.events

    events = asyncio.run(scenario())
    assert events[-2:] == ["close", "abort"]


class ReadingTransport(StuckTransport):
    """A socket whose client reads what is sent: flow control is the protocol's only."""

    def get_write_buffer_size(self) -> int:
        return 0

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def write_eof(self) -> None:
        self.events.append("eof")


async def _answer(scope: Any, receive: Any, send: Any) -> None:
    if scope["type"] == "http":
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"{}"})


REQUEST = b"GET /health HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n"


async def _drained(transport: ReadingTransport, before_drain: bytes) -> list[object]:
    """A keep-alive connection answers ``before_drain`` (none: it was just opened) and is idle when the server's drain
    begins (uvicorn's ``shutdown``), after which its client writes a request; what it wrote, up to its close."""
    config = uvicorn_config(_answer, Settings(), None, host="127.0.0.1", port=0)  # type: ignore[arg-type]
    config.load()
    protocol = config.http(config=config, server_state=ServerState(), app_state={})  # type: ignore[operator]
    protocol.connection_made(transport)
    if before_drain:
        protocol.data_received(before_drain)
        await until(lambda: any(isinstance(e, bytes) for e in transport.events), "the first answer")
    protocol.shutdown()
    if not transport.closing:
        protocol.data_received(REQUEST)
    await until(lambda: transport.closing, "the connection closed")
    protocol.connection_lost(None)
    return transport.events


def test_a_drain_answers_the_request_a_keep_alive_client_writes_next_with_connection_close() -> None:
    """uvicorn closed an idle connection at once when the drain began: the request its client had just written on it
    met a reset (a ReadError), though the server was still answering."""
    events = asyncio.run(_drained(ReadingTransport(), REQUEST))
    answers = [e for e in events if isinstance(e, bytes)]
    assert [a.startswith(b"HTTP/1.1 200 OK") for a in answers] == [True, True]
    assert b"connection: close" not in answers[0]
    assert b"connection: close" in answers[1]  # the client writes no further request on it
    assert events[-1] == "close"


def test_a_drain_answers_the_first_request_of_a_connection_just_opened() -> None:
    events = asyncio.run(_drained(ReadingTransport(), b""))
    (answer,) = (e for e in events if isinstance(e, bytes))
    assert answer.startswith(b"HTTP/1.1 200 OK")
    assert b"connection: close" in answer
    assert events[-1] == "close"
