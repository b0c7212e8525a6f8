"""``--http-workers``: a front-end relays the routes it does not answer, gathering no more of a body than a management
call's limit, slow uploads do not hold up the probes or other relayed calls, and the engine process holds each client
to its own address for wrong admin tokens. Over a real two-front-end server."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import ServerProcess, StartServer
from tests.e2e.test_http_workers import frontends
from tests.waiting import DEADLINE_S

pytestmark = pytest.mark.slow

TOKEN = "relay-admin-token-0123"
MIB = 2**20


@pytest.fixture(scope="module")
def server(server_factory: StartServer, served_tiny_store: Path) -> ServerProcess:
    return server_factory(served_tiny_store, "--http-workers", "2", env={"HALFSERVE_ADMIN_TOKEN": TOKEN})


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


async def zeros(total: int, chunk: int = MIB) -> AsyncIterator[bytes]:
    block = b"0" * chunk
    for _ in range(total // chunk):
        yield block


async def test_a_large_unauthenticated_body_is_refused_without_being_gathered(server: ServerProcess) -> None:
    pids = frontends(server)
    assert len(pids) == 2
    before = {pid: rss_mib(pid) for pid in pids}
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
        # Declared: refused from its headers.
        declared = await client.post(
            "/v2/repository/index", content=zeros(300 * MIB), headers={"Content-Length": str(300 * MIB)}
        )
        # Chunked: refused once it passes the limit, the rest dropped as it arrives.
        chunked = await client.post("/v2/repository/index", content=zeros(300 * MIB))
        for r in (declared, chunked):
            assert r.status_code == 413, r.text
            assert r.json()["error"].startswith("body:")
            assert "management call's limit" in r.json()["error"]
        # The server goes on: small management calls are answered, with and without the token.
        assert (await client.post("/v2/repository/index")).status_code == 401
        auth = {"Authorization": f"Bearer {TOKEN}"}
        index = await client.post("/v2/repository/index", json={}, headers=auth)
        assert index.status_code == 200
        assert [m["name"] for m in index.json()] == ["tiny"]
    grown = {pid: rss_mib(pid) - before[pid] for pid in pids}
    assert max(grown.values()) < 64, grown  # gathering 300 MiB grew a front-end by 600 MiB


async def test_wrong_tokens_through_the_front_ends_count_against_their_own_address_only(server: ServerProcess) -> None:
    wrong = {"Authorization": "Bearer not-the-token-at-all"}
    right = {"Authorization": f"Bearer {TOKEN}"}

    async def post(address: str, headers: dict[str, str]) -> httpx.Response:
        transport = httpx.AsyncHTTPTransport(local_address=address)
        async with httpx.AsyncClient(base_url=server.url, transport=transport, timeout=30) as client:
            return await client.post("/v2/repository/index", headers=headers)

    for i in range(10):
        # The relayed address is the front-end's to set: a client's own claim is dropped.
        forged = {**wrong, "X-Halfserve-Relayed-Client": f"10.0.0.{i}"}
        assert (await post("127.0.0.1", forged)).status_code == 401
    locked = await post("127.0.0.1", wrong)
    assert locked.status_code == 429
    assert "127.0.0.1" in locked.json()["error"]
    # The right token is accepted from that address all the same; another address is not held to its failures.
    assert (await post("127.0.0.1", right)).status_code == 200
    assert (await post("127.0.0.2", wrong)).status_code == 401


async def test_a_client_gone_mid_relayed_body_leaves_the_front_end_serving(server: ServerProcess) -> None:
    host, port = server.url.removeprefix("http://").split(":")
    for _ in range(4):
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(
            b"POST /v2/repository/index HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 1000\r\n"
            b"Authorization: Bearer " + TOKEN.encode() + b"\r\n\r\n{"
        )
        await writer.drain()
        writer.close()
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
        for _ in range(4):
            assert (await client.get("/v2/health/ready")).status_code == 200


async def test_probes_and_relayed_calls_answer_while_slow_uploads_are_relayed(server: ServerProcess) -> None:
    """250 uploads to a relayed route, a byte every 2 s: more than either front-end has connections to the engine
    process (100 each), had they held one each while their bodies arrived. Health, readiness, a relayed listing and
    inference are still answered, each on a new connection."""
    host, port = server.url.removeprefix("http://").split(":")
    uploads = []

    async def trickle() -> None:
        while True:
            for w in uploads:
                w.write(b" ")
            await asyncio.sleep(2)

    async def get(path: str) -> int:
        async with httpx.AsyncClient(base_url=server.url, timeout=DEADLINE_S) as client:
            return (await client.get(path)).status_code

    async def predict() -> int:
        async with httpx.AsyncClient(base_url=server.url, timeout=DEADLINE_S) as client:
            return (await client.post("/predict", json={"inputs": [[0.5] * 16]})).status_code

    trickling = asyncio.create_task(trickle())
    try:
        for _ in range(250):
            _, writer = await asyncio.open_connection(host, int(port))
            writer.write(b"POST /v2/repository/index HTTP/1.1\r\nHost: localhost\r\nContent-Length: 1000\r\n\r\n{")
            uploads.append(writer)
        paths = ["/health", "/ready", "/v2/health/live", "/v2/health/ready", "/models"] * 2
        answers = await asyncio.gather(*(get(p) for p in paths), predict(), predict())
    finally:
        trickling.cancel()
        for w in uploads:
            w.close()
    assert answers == [200] * len(answers), dict(zip([*paths, "predict", "predict"], answers, strict=True))


async def test_front_ends_refuse_browsers_cross_site_requests_and_non_json_bodies(server: ServerProcess) -> None:
    cross = {"Sec-Fetch-Site": "cross-site"}
    body = {"inputs": [[0.5] * 16]}
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
        answered = await client.post("/predict", json=body, headers=cross)  # answered by the front-end itself
        relayed = await client.post("/v2/repository/index", headers={**cross, "Authorization": f"Bearer {TOKEN}"})
        plain = await client.post("/predict", content=b'{"inputs": [[0.5]]}', headers={"Content-Type": "text/plain"})
        fine = await client.post("/predict", json=body)
    assert answered.status_code == relayed.status_code == 403
    assert plain.status_code == 415
    assert fine.status_code == 200
