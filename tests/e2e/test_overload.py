"""A real server under overload and under SIGTERM: every request answered 200 or 503, nothing lost, memory bounded,
and a drain that answers everything it accepted.

The model is deliberately slow (an fp32 MLP with 4096-wide layers on one torch thread), so the server saturates at a
rate the Python test client can exceed twice over on a shared CPU. Each load phase is a few seconds.
"""

from __future__ import annotations

import asyncio
import re
import signal
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import orjson
import pytest
import torch

from halfserve import models, store
from halfserve.manifest import Manifest, TensorSpec
from tests.conftest import ServerProcess
from tests.waiting import until

pytestmark = pytest.mark.slow

StartServer = Callable[..., ServerProcess]

IN_FEATURES = 64
BODY = orjson.dumps({"inputs": [[0.01 * i for i in range(IN_FEATURES)]]})
JSON = {"content-type": "application/json"}
CLIENT_TIMEOUT_S = 10.0


@pytest.fixture(scope="module")
def slow_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("slow-store")
    torch.manual_seed(0)
    kwargs = {"in_features": IN_FEATURES, "hidden": [4096, 4096], "out_features": 4}
    manifest = Manifest(
        name="slow",
        architecture="mlp",
        arch_kwargs=kwargs,
        inputs=[TensorSpec(name="x", shape=[IN_FEATURES])],
        outputs=[TensorSpec(name="y", shape=[4])],
        precision="fp32",
    )
    store.save(root, manifest, models.build("mlp", **kwargs))
    return root


def rss_kib(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    match = re.search(r"^VmRSS:\s+(\d+) kB", status, re.MULTILINE)
    assert match, status
    return int(match.group(1))


@dataclass
class Tally:
    """What a load phase saw: responses by status, and transport failures by kind."""

    sent: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    seconds: float = 0.0

    def count(self, key: str) -> int:
        return self.outcomes[key]


async def post(client: httpx.AsyncClient, tally: Tally) -> str:
    tally.sent += 1
    try:
        r = await client.post("/predict", content=BODY, headers=JSON)
        key = str(r.status_code)
    except httpx.TimeoutException:
        key = "timeout"
    except httpx.ConnectError:
        key = "connect refused"
    except httpx.TransportError as e:
        key = f"transport: {type(e).__name__}"
    tally.outcomes[key] += 1
    return key


class RawClient:
    """A minimal HTTP/1.1 client over asyncio streams, with a pool of keep-alive connections: the request bytes are
    built once, and a response costs a header scan and one read. httpx spends several times the server's own work
    per request, and on a shared CPU an open-loop httpx client falls behind its schedule before the server does."""

    def __init__(self, url: str, path: str, body: bytes) -> None:
        host, port = url.removeprefix("http://").split(":")
        self.host, self.port = host, int(port)
        self.request = (
            f"POST {path} HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n\r\n"
        ).encode() + body
        self.idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        self.opened = 0

    async def post(self) -> int:
        if self.idle:
            reader, writer = self.idle.pop()
        else:
            reader, writer = await asyncio.open_connection(self.host, self.port)
            self.opened += 1
        try:
            writer.write(self.request)
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            status = int(lines[0].split(" ", 2)[1])
            headers = dict(line.lower().split(": ", 1) for line in lines[1:] if line)
            await reader.readexactly(int(headers["content-length"]))
        except BaseException:
            writer.close()
            raise
        if headers.get("connection") == "close":
            writer.close()
        else:
            self.idle.append((reader, writer))
        return status

    def close(self) -> None:
        for _, writer in self.idle:
            writer.close()


async def raw_post(client: RawClient, tally: Tally) -> None:
    tally.sent += 1
    try:
        key = str(await asyncio.wait_for(client.post(), CLIENT_TIMEOUT_S))
    except asyncio.TimeoutError:
        key = "timeout"
    except (OSError, asyncio.IncompleteReadError) as e:
        key = f"transport: {type(e).__name__}"
    tally.outcomes[key] += 1


async def closed_loop(url: str, concurrency: int, seconds: float) -> Tally:
    """``concurrency`` clients, each sending its next request when the last is answered."""
    tally = Tally()
    client = RawClient(url, "/predict", BODY)
    start = time.monotonic()

    async def worker() -> None:
        while time.monotonic() < start + seconds:
            await raw_post(client, tally)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    tally.seconds = time.monotonic() - start
    client.close()
    return tally


async def open_loop(url: str, rate: float, seconds: float) -> Tally:
    """Send at ``rate`` per second whatever the answers, each request on its own task."""
    tally = Tally()
    client = RawClient(url, "/predict", BODY)
    loop = asyncio.get_running_loop()
    start = loop.time()
    tasks = []
    for i in range(int(rate * seconds)):
        delay = start + i / rate - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(raw_post(client, tally)))
    tally.seconds = loop.time() - start
    await asyncio.gather(*tasks)
    client.close()
    return tally


def test_twice_the_capacity_is_answered_200_or_503_with_nothing_lost_and_memory_bounded(
    server_factory: StartServer, slow_store: Path
) -> None:
    server = server_factory(
        slow_store, "--threads", "1", "--max-batch-size", "1", "--max-queue-rows", "4", "--max-delay-ms", "0"
    )
    pid = server.proc.pid
    # Capacity, closed loop: never more requests outstanding than the queue holds, so nothing is refused.
    warm = asyncio.run(closed_loop(server.url, concurrency=4, seconds=2.0))
    assert set(warm.outcomes) == {"200"}, warm.outcomes
    capacity = warm.count("200") / warm.seconds
    rss_before = rss_kib(pid)
    stats_before = httpx.get(f"{server.url}/models/slow/stats").json()

    offered = 2 * capacity
    storm = asyncio.run(open_loop(server.url, rate=offered, seconds=5.0))
    rss_after = rss_kib(pid)
    stats_after = httpx.get(f"{server.url}/models/slow/stats").json()
    ok, busy = storm.count("200"), storm.count("503")
    print(
        f"\ncapacity {capacity:.0f} req/s; offered {storm.sent / storm.seconds:.0f} req/s for {storm.seconds:.1f} s: "
        f"{storm.sent} sent, {ok} x 200, {busy} x 503, other {dict(storm.outcomes - Counter({'200': ok, '503': busy}))}"
        f"; RSS {rss_before / 1024:.0f} MiB -> {rss_after / 1024:.0f} MiB"
    )
    assert storm.sent == ok + busy, storm.outcomes  # none lost, none hung past the client's timeout
    assert busy > 0, "not overloaded: no request was refused"
    assert ok > 0
    # The server saw the same: every 200 was a request it answered, every 503 one it refused at admission.
    assert stats_after["succeeded"] - stats_before["succeeded"] == ok
    assert stats_after["rejected"] - stats_before["rejected"] == busy
    # Refusing is cheap and queues are bounded: memory does not grow with the excess.
    assert rss_after < rss_before * 1.25 + 64 * 1024, (rss_before, rss_after)

    # And afterwards it serves normally again.
    with httpx.Client(base_url=server.url, timeout=CLIENT_TIMEOUT_S) as client:
        for _ in range(5):
            r = client.post("/predict", content=BODY, headers=JSON)
            assert r.status_code == 200, r.text
            assert len(r.json()["outputs"]) == 1
        assert client.get("/models/slow/stats").json()["queued_rows"] == 0
    server.stop()


DRAINED = re.compile(r"model slow drained: (\d+) requests accepted, (\d+) answered with outputs, (\d+) not")


def test_sigterm_under_load_answers_every_accepted_request_then_exits(
    server_factory: StartServer, slow_store: Path
) -> None:
    server = server_factory(
        slow_store,
        "--threads",
        "1",
        "--max-batch-size",
        "4",
        "--max-queue-rows",
        "256",
        "--max-delay-ms",
        "20",
        "--drain-timeout",
        "10",
    )
    signalled: list[float] = []
    exited: list[float] = []
    in_flight_at_signal = 0

    async def load() -> Tally:
        nonlocal in_flight_at_signal
        tally = Tally()
        # No keep-alive: each request opens its own connection, so a refusal after the signal is a failed connect
        # (or a reset of a connection the server never read), never a request lost on a reused connection.
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=server.url, timeout=CLIENT_TIMEOUT_S, limits=limits) as client:
            give_up = time.monotonic() + 15.0

            async def worker() -> None:
                nonlocal in_flight_at_signal
                while not exited and time.monotonic() < give_up:
                    sent = time.monotonic()
                    key = await post(client, tally)
                    if key == "200" and signalled and sent < signalled[0]:
                        in_flight_at_signal += 1
                    if key != "200":
                        await asyncio.sleep(0.05)  # refused: the server is going away; do not spin

            async def terminate() -> None:
                await asyncio.sleep(1.5)
                signalled.append(time.monotonic())
                server.proc.send_signal(signal.SIGTERM)
                rc = await asyncio.to_thread(server.proc.wait, 15)
                exited.append(time.monotonic())
                assert rc in (0, -signal.SIGTERM)  # uvicorn re-raises the signal once it has shut down cleanly

            await asyncio.gather(terminate(), *(worker() for _ in range(32)))
        return tally

    tally = asyncio.run(load())
    exited_after = exited[0] - signalled[0]
    log = server.log.read_text()
    match = DRAINED.search(log)
    assert match, log[-3000:]
    accepted, answered, unanswered = map(int, match.groups())
    refused = {k: v for k, v in tally.outcomes.items() if k != "200"}
    print(
        f"\n{tally.sent} sent: {tally.count('200')} x 200 ({in_flight_at_signal} in flight at SIGTERM), "
        f"refused at the socket {refused}; server accepted {accepted}, answered {answered}; "
        f"exited {exited_after:.2f} s after SIGTERM"
    )
    assert "Finished server process" in log
    assert in_flight_at_signal > 0  # the signal did arrive with requests in flight
    # Every response the client got was a 200: no 5xx, no 503 for a request already accepted.
    assert all(k == "200" or k.startswith(("connect", "transport")) for k in tally.outcomes), tally.outcomes
    # Every request the server accepted was answered with its outputs, and the client received each of them.
    assert unanswered == 0
    assert answered == accepted == tally.count("200")
    assert exited_after < 10


def test_a_request_outlasting_the_drain_timeout_is_cut_off_and_the_server_still_exits_on_time(
    server_factory: StartServer, slow_store: Path
) -> None:
    server = server_factory(
        slow_store, "--threads", "1", "--max-batch-size", "1", "--max-request-rows", "1000", "--drain-timeout", "1"
    )
    # 1000 rows one at a time: seconds of work, far past the drain timeout.
    body = orjson.dumps({"inputs": [[0.0] * IN_FEATURES] * 1000})

    async def run() -> tuple[httpx.Response, float]:
        async with httpx.AsyncClient(base_url=server.url, timeout=CLIENT_TIMEOUT_S) as client:
            long = asyncio.ensure_future(client.post("/predict", content=body, headers=JSON))
            stats = f"{server.url}/models/slow/stats"
            await until(lambda: httpx.get(stats).json()["batches"] >= 5, "5 batches of the long request", every=0.05)
            server.proc.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            response = await long
            await asyncio.to_thread(server.proc.wait, 15)
            return response, time.monotonic() - signalled

    response, exited_after = asyncio.run(run())
    log = server.log.read_text()
    print(f"\nlong request: {response.status_code}; exited {exited_after:.2f} s after SIGTERM, drain timeout 1 s")
    # Cut off while still running, and told so: retry elsewhere.
    assert response.status_code == 503
    assert response.headers["retry-after"] == "1"
    assert response.json() == {
        "error": "server is shutting down: the drain timeout passed before this request was answered"
    }
    assert "timeout graceful shutdown exceeded" in log
    assert exited_after < 1 + 3
