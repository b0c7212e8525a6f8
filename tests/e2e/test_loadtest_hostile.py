"""``halfserve loadtest --url`` against a slow or hostile server: every run ends, bounded, with the misbehaviour
counted or refused in one line, and the report is written even when no request succeeded.

The server is a small raw-socket HTTP/1.1 server on 127.0.0.1 in a thread of the test: it answers the listing, the
stats, the health check and the load test's first (probing) ``POST /predict`` normally, and then misbehaves as a test
asks. The load test runs as a subprocess with a generous timeout, so a regression fails instead of hanging.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from enum import Enum
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT

MODEL = "m"
RUN_LIMIT_S = 90
"""Far above what a bounded run takes (a few seconds): reaching it means the client was held."""
HUGE_ANSWER_MIB = 96
"""Over the client's 64 MiB cap on one answer, small enough to send quickly."""


class Misbehaviour(str, Enum):
    TRICKLE = "trickle"
    """Later answers declare ``Content-Length: 100000`` and then send one byte every 0.5 s."""
    TRICKLE_ALL = "trickle-all"
    """Every ``/predict`` answer trickles, the probing first one included."""
    HUGE = "huge"
    """Later answers are chunked and run on past the client's cap."""
    UNAVAILABLE = "unavailable"
    """Later answers are 503."""
    HUGE_SHAPE = "huge-shape"
    """The listing declares an input of shape [40000, 40000]."""
    TRICKLE_HEAD = "trickle-head"
    """The listing's answer head never ends: a header's bytes come one every 0.2 s, each within httpx's read timeout."""
    NESTED = "nested"
    """The listing is JSON nested 100,000 deep, past any parser's recursion limit."""
    BAD_NAME = "bad-name"
    """The listing's one model is named with a path and a terminal escape."""
    NESTED_DEVICE = "nested-device"
    """The listing names the model's device with an array nested 500 deep: within the parser's depth."""
    ESCAPED_PRECISION = "escaped-precision"
    """Every ``/predict`` answer says it was served in a precision holding a terminal escape."""
    ESCAPED_SHAPE = "escaped-shape"
    """The listing declares the input's shape as a string holding a terminal escape."""
    ESCAPED_DATATYPE = "escaped-datatype"
    """The listing declares the input's datatype as a string holding a terminal escape."""


BAD_NAME = "\x1b[2J../../admin"
ESCAPE = "\x1b[2J"
"""Clears the terminal: what a server's words must not do when printed."""
NESTED_DEPTH = 500
"""Parsed by any JSON parser here; past what a recursive copy of the parsed value can follow."""


def _listing(shape: list[int]) -> dict[str, Any]:
    inputs = [{"name": "x", "datatype": "FP32", "shape": shape}]
    return {"models": [{"name": MODEL, "state": "ready", "version": "1", "device": "cpu", "inputs": inputs}]}


class HostileServer:
    """Answers HTTP/1.1 on 127.0.0.1 with keep-alive, misbehaving on ``/predict`` after the first as ``mode`` says."""

    def __init__(self, mode: Misbehaviour) -> None:
        self.mode = mode
        self.predicts = 0
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self.port = 0
        self._thread = threading.Thread(target=self._run, daemon=True, name="hostile-server")
        self._thread.start()
        assert self._ready.wait(30), "the hostile server did not start"

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        server = self.loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", 0))
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        self.loop.run_forever()
        server.close()
        self.loop.close()

    def stop(self) -> None:
        async def cancel_all() -> None:
            current = asyncio.current_task()
            for task in asyncio.all_tasks():
                if task is not current:
                    task.cancel()

        asyncio.run_coroutine_threadsafe(cancel_all(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(30)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                headers = dict(line.lower().split(": ", 1) for line in lines[1:] if ": " in line)
                await reader.readexactly(int(headers.get("content-length", "0")))
                await self._answer(method, path, writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def _answer(self, method: str, path: str, writer: asyncio.StreamWriter) -> None:
        if path == "/models" and self.mode is Misbehaviour.TRICKLE_HEAD:
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nx-slow: ")
            while True:
                writer.write(b"a")
                await writer.drain()
                await asyncio.sleep(0.2)
        if path == "/models" and self.mode is Misbehaviour.NESTED:
            depth = 100_000
            return await self._raw(writer, 200, b"[" * depth + b"]" * depth)
        if path == "/models" and self.mode is Misbehaviour.BAD_NAME:
            listing = _listing([4])
            listing["models"][0]["name"] = BAD_NAME
            return await self._json(writer, 200, listing)
        if path == "/models" and self.mode is Misbehaviour.NESTED_DEVICE:
            listing = json.dumps(_listing([4])).replace('"cpu"', "[" * NESTED_DEPTH + "]" * NESTED_DEPTH)
            return await self._raw(writer, 200, listing.encode())
        if path == "/models" and self.mode in (Misbehaviour.ESCAPED_SHAPE, Misbehaviour.ESCAPED_DATATYPE):
            listing = _listing([4])
            key = "shape" if self.mode is Misbehaviour.ESCAPED_SHAPE else "datatype"
            listing["models"][0]["inputs"][0][key] = f"{ESCAPE}{key}"
            return await self._json(writer, 200, listing)
        if path == "/models":
            shape = [40000, 40000] if self.mode is Misbehaviour.HUGE_SHAPE else [4]
            return await self._json(writer, 200, _listing(shape))
        if path == f"/models/{MODEL}/stats":
            return await self._json(writer, 200, {"rows": 0, "batches": 0})
        if path == "/health":
            return await self._json(writer, 200, {"status": "ok"})
        if method != "POST" or path != "/predict":
            return await self._json(writer, 404, {"detail": "not found"})
        self.predicts += 1
        first = self.predicts == 1
        if self.mode is Misbehaviour.TRICKLE_ALL or (self.mode is Misbehaviour.TRICKLE and not first):
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 100000\r\n\r\n")
            for _ in range(100_000):
                writer.write(b" ")
                await writer.drain()
                await asyncio.sleep(0.5)
        if self.mode is Misbehaviour.HUGE and not first:
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n")
            chunk = b" " * (1 << 20)
            for _ in range(HUGE_ANSWER_MIB):
                writer.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                await writer.drain()
            writer.write(b"0\r\n\r\n")
            return await writer.drain()
        if self.mode is Misbehaviour.UNAVAILABLE and not first:
            return await self._json(writer, 503, {"detail": "unavailable"})
        precision = f"{ESCAPE}fp32" if self.mode is Misbehaviour.ESCAPED_PRECISION else "fp32"
        return await self._json(writer, 200, {"model": MODEL, "outputs": [[0.0]], "precision": precision})

    @staticmethod
    async def _json(writer: asyncio.StreamWriter, status: int, body: dict[str, Any]) -> None:
        await HostileServer._raw(writer, status, json.dumps(body).encode())

    @staticmethod
    async def _raw(writer: asyncio.StreamWriter, status: int, data: bytes) -> None:
        head = f"HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: {len(data)}\r\n\r\n"
        writer.write(head.encode() + data)
        await writer.drain()


@pytest.fixture
def hostile(request: pytest.FixtureRequest) -> Iterator[HostileServer]:
    server = HostileServer(request.param)
    try:
        yield server
    finally:
        server.stop()


def refusal(proc: subprocess.CompletedProcess[str]) -> str:
    """The one line a run refused before its sweep prints: exit 2, and nothing else on stderr."""
    assert proc.returncode == 2, proc.stderr
    [line] = proc.stderr.strip().splitlines()
    return line


def loadtest(
    server: HostileServer, out: Path, *extra: str, model: str | None = MODEL
) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "halfserve", "loadtest", "--url", f"http://127.0.0.1:{server.port}"]
    cmd += ["--model", model] if model is not None else []
    cmd += ["--concurrency", "1", "--duration", "1", "--warmup", "0", "--timeout", "2"]
    cmd += ["--client-ceiling", "0", "--no-progress", "--out", str(out), *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=RUN_LIMIT_S, cwd=ROOT)


def level(out: Path) -> dict[str, Any]:
    results: list[dict[str, Any]] = json.loads((out / "loadtest.json").read_text())["results"]
    assert len(results) == 1
    return results[0]


@pytest.mark.parametrize("hostile", [Misbehaviour.TRICKLE], indirect=True)
def test_a_trickled_answer_times_out_as_a_whole(hostile: HostileServer, tmp_path: Path) -> None:
    proc = loadtest(hostile, tmp_path)
    assert proc.returncode == 0, proc.stderr
    result = level(tmp_path)
    # One user, whose first request in the level trickles: it ends at --timeout, and the level with it.
    assert result["successes"] == 0
    assert result["errors_by_exception"] == {"RequestTimeout": result["requests"]}
    assert result["requests"] >= 1
    assert (tmp_path / "loadtest.png").is_file()


@pytest.mark.parametrize("hostile", [Misbehaviour.TRICKLE_ALL], indirect=True)
def test_a_trickled_probe_fails_the_run_in_one_line(hostile: HostileServer, tmp_path: Path) -> None:
    proc = loadtest(hostile, tmp_path)
    assert refusal(proc) == (
        f"halfserve loadtest: error: POST http://127.0.0.1:{hostile.port}/predict: no whole answer within 2 s"
    )


@pytest.mark.parametrize("hostile", [Misbehaviour.HUGE], indirect=True)
def test_an_answer_past_the_cap_is_an_error_not_read_whole(hostile: HostileServer, tmp_path: Path) -> None:
    proc = loadtest(hostile, tmp_path)
    assert proc.returncode == 0, proc.stderr
    result = level(tmp_path)
    assert result["successes"] == 0
    assert result["errors_by_exception"] == {"AnswerTooLarge": result["requests"]}


@pytest.mark.parametrize("hostile", [Misbehaviour.UNAVAILABLE], indirect=True)
def test_a_level_without_a_success_is_reported(hostile: HostileServer, tmp_path: Path) -> None:
    proc = loadtest(hostile, tmp_path)
    assert proc.returncode == 0, proc.stderr
    result = level(tmp_path)
    assert result["successes"] == 0
    assert result["errors_by_status"] == {"503": result["requests"]}
    assert result["p99_ms"] is None
    assert (tmp_path / "loadtest.png").read_bytes().startswith(b"\x89PNG")
    table = (tmp_path / "loadtest.md").read_text()
    assert f"{result['requests']} (503: {result['requests']})" in table
    assert "! no successful request (no latency, see errors): fp32 c=1" in table


@pytest.mark.parametrize("hostile", [Misbehaviour.HUGE_SHAPE], indirect=True)
def test_an_absurd_signature_is_refused_before_allocating(hostile: HostileServer, tmp_path: Path) -> None:
    proc = loadtest(hostile, tmp_path)
    assert refusal(proc) == (
        "halfserve loadtest: error: model 'm': input 'x' declares shape [40000, 40000], 1,600,000,000 values per "
        "request (1 row(s)); the load test sends at most 16,777,216"
    )
    assert hostile.predicts == 0


@pytest.mark.parametrize("hostile", [Misbehaviour.TRICKLE_HEAD], indirect=True)
def test_a_listing_whose_head_never_ends_fails_the_run_at_the_timeout(hostile: HostileServer, tmp_path: Path) -> None:
    # Each byte comes well within httpx's 2 s read timeout: only a bound on the request as a whole ends it (before,
    # the run was held until RUN_LIMIT_S).
    proc = loadtest(hostile, tmp_path)
    assert refusal(proc) == (
        f"halfserve loadtest: error: GET http://127.0.0.1:{hostile.port}/models: no whole answer within 2 s"
    )


@pytest.mark.parametrize("hostile", [Misbehaviour.NESTED], indirect=True)
def test_a_listing_nested_past_the_parser_s_limit_is_refused_in_one_line(
    hostile: HostileServer, tmp_path: Path
) -> None:
    proc = loadtest(hostile, tmp_path)
    line = refusal(proc)
    assert line.startswith(
        f"halfserve loadtest: error: GET http://127.0.0.1:{hostile.port}/models: not a model listing (RecursionError: "
    )


NAME_REFUSAL = f"model name {BAD_NAME!r} is invalid: use letters, digits, '_', '.', '-' (max 64)"


@pytest.mark.parametrize(
    ("hostile", "model", "said"),
    [
        (Misbehaviour.BAD_NAME, None, NAME_REFUSAL),
        # Before, it was parsed, swept, and then crashed the report with a RecursionError (exit 1, a long traceback).
        (Misbehaviour.NESTED_DEVICE, MODEL, "the entry of 'm': device is an array, expected a string or a number"),
    ],
    indirect=["hostile"],
    ids=["name", "nested-device"],
)
def test_a_listing_the_run_cannot_use_is_refused_in_one_line_before_any_request(
    hostile: HostileServer, tmp_path: Path, model: str | None, said: str
) -> None:
    proc = loadtest(hostile, tmp_path, model=model)
    assert refusal(proc) == f"halfserve loadtest: error: GET http://127.0.0.1:{hostile.port}/models: {said}"
    assert "\x1b" not in proc.stderr
    assert hostile.predicts == 0


@pytest.mark.parametrize("hostile", [Misbehaviour.ESCAPED_PRECISION], indirect=True)
def test_a_served_precision_with_a_control_character_is_printed_and_recorded_quoted(
    hostile: HostileServer, tmp_path: Path
) -> None:
    proc = loadtest(hostile, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "\x1b" not in proc.stdout + proc.stderr
    assert level(tmp_path)["served_precision"] == repr(f"{ESCAPE}fp32")
    assert "\x1b" not in (tmp_path / "loadtest.md").read_text()


@pytest.mark.parametrize(
    ("hostile", "protocol", "said"),
    [
        (Misbehaviour.ESCAPED_SHAPE, "predict", "model 'm': GET /models lists no usable input (ValueError: shape "),
        (Misbehaviour.ESCAPED_DATATYPE, "v2-json", "input 'x': datatype "),
    ],
    indirect=["hostile"],
)
def test_a_listed_input_with_a_control_character_is_refused_quoted(
    hostile: HostileServer, protocol: str, said: str, tmp_path: Path
) -> None:
    proc = loadtest(hostile, tmp_path, "--protocol", protocol)
    line = refusal(proc)
    key = "shape" if hostile.mode is Misbehaviour.ESCAPED_SHAPE else "datatype"
    assert line.startswith(f"halfserve loadtest: error: {said}{f'{ESCAPE}{key}'!r}")
    assert hostile.predicts == 0
