"""The load generator: a separate process driving N virtual users, each with one request in flight at a time.

Run by :class:`halfserve.loadtest.client.LoadClient` as ``python -m halfserve.loadtest.worker --url BASE``; it reads one
JSON command per line on stdin and answers with JSON lines on stdout::

    {"op": "template", "name": "infer", "template": {...}}       -> {"ok": "template"}
    {"op": "run", "template": "infer", "concurrency": 8,
     "duration": 10.0 | null, "requests": 500 | null, "first_user": 0}  -> {"progress": n} ... {"result": {...}}

Why it looks like this:

* Each virtual user owns its own ``httpx.AsyncClient`` holding one keep-alive connection. A single client shared by
  many users goes through httpcore's connection pool, whose bookkeeping grows with the number of connections: on a
  2-core machine it drove GET /health at 650 req/s with 64 users against 2,800 req/s with a client per user.
* Requests are built once (``httpx.Request`` objects over pre-encoded bodies, timeout set) and sent as they are, so
  no JSON is encoded and no headers are merged per request.
* uvloop runs the event loop when it is installed (``--loop asyncio`` to compare).
* Only the counters, the latencies and the CPU time go back to the parent, once per level.
* Each request is bounded as a whole, not only between bytes: ``--timeout`` seconds from sending to the answer's last
  byte (a server trickling one byte at a time would otherwise hold a user, and the level, for as long as it likes),
  and an answer is read to at most :data:`MAX_ANSWER_BYTES`. So a level ends by its duration plus one timeout.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
import traceback
from array import array
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import grpc
import httpx
import numpy as np
import orjson

from halfserve.loadtest.payload import RequestTemplate
from halfserve.loadtest.stats import LevelSample

PROGRESS_INTERVAL_S = 0.25
MAX_ANSWER_BYTES = 64 << 20
"""The most of one answer a user reads (decoded): far above any inference answer the load test sends for, far
below what would exhaust the client's memory; a longer answer is an error."""


class AnswerTooLarge(Exception):
    """The server's answer ran past :data:`MAX_ANSWER_BYTES`."""


class RequestTimeout(Exception):
    """The whole request, sending to the answer's last byte, took longer than ``--timeout``."""


Sender = Callable[[int], Awaitable[str | None]]
"""One virtual user's way to send its ``k``-th request: None when answered, else what failed it (a status)."""


def send(msg: dict[str, Any]) -> None:
    sys.stdout.buffer.write(orjson.dumps(msg) + b"\n")
    sys.stdout.buffer.flush()


class Users:
    """Virtual users against one server: one keep-alive connection each, kept across levels."""

    def __init__(
        self,
        base_url: str,
        timeout: float,
        transport: Callable[[], httpx.AsyncBaseTransport] | None = None,
    ) -> None:
        self.base_url = base_url
        self.timeout = httpx.Timeout(timeout)
        self.total_timeout = timeout
        self._transport = transport
        self.clients: list[httpx.AsyncClient] = []
        self.templates: dict[str, list[httpx.Request]] = {}
        self.grpc_templates: dict[str, RequestTemplate] = {}
        self.channels: dict[str, list[grpc.aio.Channel]] = {}
        self.done = 0

    def add_template(self, name: str, template: RequestTemplate) -> None:
        if template.grpc_target is not None:
            self.grpc_templates[name] = template
            return
        url = self.base_url + template.path
        ext = {"timeout": self.timeout.as_dict()}
        self.templates[name] = [
            httpx.Request(template.method, url, content=body, headers=template.headers, extensions=ext)
            for body in template.bodies
        ]

    def _grow(self, count: int) -> None:
        limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
        while len(self.clients) < count:
            transport = self._transport() if self._transport is not None else None
            self.clients.append(httpx.AsyncClient(limits=limits, timeout=self.timeout, transport=transport))

    async def run(
        self, name: str, concurrency: int, duration: float | None, requests: int | None, first_user: int = 0
    ) -> LevelSample:
        """Drive ``concurrency`` users until ``duration`` seconds have passed or ``requests`` have been sent."""
        if (duration is None) == (requests is None):
            raise ValueError("give exactly one of duration and requests")
        if name in self.grpc_templates:
            senders = self._grpc_senders(self.grpc_templates[name], concurrency)
        else:
            senders = self._http_senders(self.templates[name], concurrency)
        latencies = array("d")
        status: Counter[str] = Counter()
        exceptions: Counter[str] = Counter()
        self.done = 0
        issued = 0
        start = time.perf_counter()
        deadline = start + duration if duration is not None else float("inf")
        limit = requests if requests is not None else sys.maxsize

        async def user(index: int) -> None:
            nonlocal issued
            send = senders[index]
            k = first_user + index
            clock = time.perf_counter
            while issued < limit and clock() < deadline:
                issued += 1
                t0 = clock()
                try:
                    failure = await _within(send(k), self.total_timeout)
                except (httpx.HTTPError, AnswerTooLarge, RequestTimeout) as e:
                    exceptions[type(e).__name__] += 1
                else:
                    if failure is None:
                        latencies.append(clock() - t0)
                    else:
                        status[failure] += 1
                k += 1
                self.done += 1

        cpu = time.process_time()
        await asyncio.gather(*(user(i) for i in range(concurrency)))
        return LevelSample(
            latencies=_to_numpy(latencies),
            errors_by_status=dict(status),
            errors_by_exception=dict(exceptions),
            elapsed_s=time.perf_counter() - start,
            client_cpu_s=time.process_time() - cpu,
        )

    def _http_senders(self, reqs: list[httpx.Request], concurrency: int) -> list[Sender]:
        """Per user: send the k-th request on the user's own connection; the failure is the HTTP status."""
        self._grow(concurrency)

        def sender(client: httpx.AsyncClient) -> Sender:
            async def send(k: int) -> str | None:
                response = await client.send(reqs[k % len(reqs)], stream=True)
                try:
                    await _read_bounded(response)
                finally:
                    await response.aclose()
                return None if response.status_code == 200 else str(response.status_code)

            return send

        return [sender(c) for c in self.clients[:concurrency]]

    def _grpc_senders(self, template: RequestTemplate, concurrency: int) -> list[Sender]:
        """Per user: call the method with the k-th body, as the serialized message it is, on the user's own channel
        (one HTTP/2 connection); the answer is left unparsed, the failure is the gRPC status code."""
        assert template.grpc_target is not None
        channels = self.channels.setdefault(template.grpc_target, [])
        while len(channels) < concurrency:
            # A subchannel pool of its own per channel, or channels to one target share one connection.
            options = [("grpc.use_local_subchannel_pool", 1), ("grpc.max_receive_message_length", MAX_ANSWER_BYTES)]
            channels.append(grpc.aio.insecure_channel(template.grpc_target, options=options))
        bodies, timeout = template.bodies, self.timeout.read

        def sender(channel: grpc.aio.Channel) -> Sender:
            call = channel.unary_unary(template.path)

            async def send(k: int) -> str | None:
                try:
                    await call(bodies[k % len(bodies)], timeout=timeout)
                except grpc.aio.AioRpcError as e:
                    return str(e.code().name)
                return None

            return send

        return [sender(c) for c in channels[:concurrency]]

    async def close(self) -> None:
        for client in self.clients:
            await client.aclose()
        for channels in self.channels.values():
            for channel in channels:
                await channel.close()


async def _within(request: Awaitable[str | None], seconds: float) -> str | None:
    """``request``'s outcome, or :class:`RequestTimeout` once it has run ``seconds`` (cancelled, its connection
    closed)."""
    try:
        return await asyncio.wait_for(request, seconds)
    except asyncio.TimeoutError:
        raise RequestTimeout(f"no whole answer within {seconds:g} s") from None


async def _read_bounded(response: httpx.Response) -> None:
    """Read the answer, refusing one longer than :data:`MAX_ANSWER_BYTES` before more of it is read."""
    declared = response.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_ANSWER_BYTES:
        raise AnswerTooLarge(f"Content-Length {declared} is over {MAX_ANSWER_BYTES} bytes")
    read = 0
    async for chunk in response.aiter_bytes():
        read += len(chunk)
        if read > MAX_ANSWER_BYTES:
            raise AnswerTooLarge(f"answer over {MAX_ANSWER_BYTES} bytes")


def _to_numpy(values: array[float]) -> np.ndarray:
    return np.frombuffer(values, dtype=np.float64).copy() if len(values) else np.empty(0, dtype=np.float64)


async def _report_progress(users: Users) -> None:
    while True:
        await asyncio.sleep(PROGRESS_INTERVAL_S)
        send({"progress": users.done})


async def serve(base_url: str, timeout: float) -> None:
    """Answer commands from stdin until it closes."""
    loop = asyncio.get_running_loop()
    users = Users(base_url, timeout)
    send({"ready": True, "loop": type(loop).__module__.split(".")[0]})
    try:
        while True:
            line = await loop.run_in_executor(None, sys.stdin.buffer.readline)
            if not line.strip():
                return
            cmd = orjson.loads(line)
            if cmd["op"] == "template":
                users.add_template(cmd["name"], RequestTemplate.from_message(cmd["template"]))
                send({"ok": "template"})
            elif cmd["op"] == "run":
                progress = asyncio.create_task(_report_progress(users))
                try:
                    sample = await users.run(
                        cmd["template"], cmd["concurrency"], cmd.get("duration"), cmd.get("requests"), cmd["first_user"]
                    )
                finally:
                    progress.cancel()
                send({"progress": users.done})
                send({"result": sample.to_message()})
            else:
                raise ValueError(f"unknown command {cmd['op']!r}")
    finally:
        await users.close()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m halfserve.loadtest.worker", description=__doc__)
    parser.add_argument("--url", required=True, help="the server's base URL")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds per request")
    parser.add_argument("--loop", choices=["uvloop", "asyncio"], default="uvloop")
    args = parser.parse_args(argv)
    try:
        if args.loop == "uvloop":
            try:
                import uvloop
            except ImportError:
                asyncio.run(serve(args.url, args.timeout))
            else:
                uvloop.run(serve(args.url, args.timeout))
        else:
            asyncio.run(serve(args.url, args.timeout))
    except KeyboardInterrupt:
        return 130
    except Exception:
        send({"error": traceback.format_exc()})
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
