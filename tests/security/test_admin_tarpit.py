"""Past the lockout's limit a wrong admin token is answered 429 only after the tarpit holds it, at most a few at once
per address: a burst of guesses from one address used to be answered at 678 a second, each 429 telling the guesser
that token was wrong. The right token is never held."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from types import SimpleNamespace

import grpc
import httpx
import pytest
from tritonclient.grpc import service_pb2

from halfserve.api.access import check_admin
from halfserve.api.errors import APIError, HeldError
from halfserve.api.lockout import Tarpit, tarpit
from halfserve.settings import Settings
from tests.conftest import ServerProcess, StartServer, free_port
from tests.waiting import DEADLINE_S

TOKEN = "a-long-enough-admin-token"
LIMIT = 10
"""Wrong tokens a minute from one address answered 401 (FailedAttempts' limit); past it, 429."""
BURST = 16
WINDOW_S = 2.5
ANSWERED_IN_WINDOW = 8
"""At most this many of the burst answered within ``WINDOW_S`` of its start: the tarpit lets through 2 a second per
address (slots / delay), so about 4 come in that window; unheld, all 16 came in a few milliseconds. A slow host only
answers fewer."""


@pytest.fixture(scope="module")
def server(server_factory: StartServer, served_tiny_store: Path) -> ServerProcess:
    return server_factory(served_tiny_store, env={"HALFSERVE_ADMIN_TOKEN": TOKEN})


def index(client: httpx.AsyncClient, token: str) -> asyncio.Task[httpx.Response]:
    call = client.post("/v2/repository/index", headers={"Authorization": f"Bearer {token}"})
    return asyncio.ensure_future(call)


async def test_a_burst_of_wrong_tokens_is_answered_at_a_bounded_rate_and_the_right_one_at_once(
    server: ServerProcess,
) -> None:
    limits = httpx.Limits(max_connections=BURST + 4)
    async with httpx.AsyncClient(base_url=server.url, limits=limits, timeout=DEADLINE_S) as client:
        first = [await index(client, f"guess-{i}") for i in range(LIMIT)]
        assert [r.status_code for r in first] == [401] * LIMIT
        start = time.monotonic()
        burst = [index(client, f"guess-{LIMIT + i}") for i in range(BURST)]
        done, _ = await asyncio.wait(burst, timeout=WINDOW_S)
        answered_in_window = len(done)
        # The right token, sent while the burst's guesses are held: accepted, before the last of them is answered.
        right = await index(client, TOKEN)
        assert right.status_code == 200, right.text
        assert not all(guess.done() for guess in burst)
        answers = await asyncio.wait_for(asyncio.gather(*burst), DEADLINE_S)
        took = time.monotonic() - start
    assert answered_in_window <= ANSWERED_IN_WINDOW, answered_in_window
    assert [r.status_code for r in answers] == [429] * BURST
    assert answers[0].json()["error"].startswith("too many wrong admin tokens from 127.0.0.1")
    # The whole burst took at least as long as the tarpit lets it (16 answers at 2 a second, held 1 s each).
    assert took >= (BURST / 2 - 1) * 1.0
    health = httpx.get(f"{server.url}/health", timeout=DEADLINE_S)
    assert health.status_code == 200


def repository_index(channel: grpc.aio.Channel, token: str) -> asyncio.Task[grpc.StatusCode]:
    """A gRPC RepositoryIndex call with ``token``, to the status it ends with."""
    call = channel.unary_unary(
        "/inference.GRPCInferenceService/RepositoryIndex",
        request_serializer=service_pb2.RepositoryIndexRequest.SerializeToString,
        response_deserializer=service_pb2.RepositoryIndexResponse.FromString,
    )

    async def status() -> grpc.StatusCode:
        try:
            await call(
                service_pb2.RepositoryIndexRequest(),
                metadata=(("authorization", f"Bearer {token}"),),
                timeout=DEADLINE_S,
            )
        except grpc.aio.AioRpcError as e:
            return e.code()
        return grpc.StatusCode.OK

    return asyncio.ensure_future(status())


async def test_over_grpc_too_a_burst_is_answered_at_a_bounded_rate(
    server_factory: StartServer, served_tiny_store: Path
) -> None:
    port = free_port()
    server_factory(served_tiny_store, "--grpc", "--grpc-port", str(port), env={"HALFSERVE_ADMIN_TOKEN": TOKEN})
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        first = [await repository_index(channel, f"guess-{i}") for i in range(LIMIT)]
        assert first == [grpc.StatusCode.UNAUTHENTICATED] * LIMIT
        burst = [repository_index(channel, f"guess-{LIMIT + i}") for i in range(BURST)]
        done, _ = await asyncio.wait(burst, timeout=WINDOW_S)
        answered_in_window = len(done)
        assert await repository_index(channel, TOKEN) == grpc.StatusCode.OK
        assert not all(guess.done() for guess in burst)
        answers = await asyncio.wait_for(asyncio.gather(*burst), DEADLINE_S)
    assert answered_in_window <= ANSWERED_IN_WINDOW, answered_in_window
    assert answers == [grpc.StatusCode.RESOURCE_EXHAUSTED] * BURST


async def test_the_tarpit_holds_each_address_apart_and_forgets_it_when_none_waits() -> None:
    tarpit = Tarpit(delay=0.05, slots=1)
    released: list[str] = []

    async def guess(who: str) -> None:
        await tarpit.hold(who)
        released.append(who)

    a = [asyncio.ensure_future(guess("a")) for _ in range(3)]
    b = asyncio.ensure_future(guess("b"))
    await asyncio.wait_for(asyncio.gather(b, *a), DEADLINE_S)
    # "b" waited for no slot of "a"'s: released with the first of "a"'s three (one slot each), not behind them all.
    assert released.index("b") <= 1, released
    assert released.count("a") == 3
    assert tarpit.gates == {}
    assert not tarpit.waiting


async def test_a_full_tarpit_refuses_its_address_at_once_whatever_the_token() -> None:
    """A flood of guesses holds at most ``queue`` answers (and connections) of its address: past that, its admin calls
    are refused at once with the token unread, so the refusal tells no guess apart; other addresses are served."""
    app = SimpleNamespace(settings=Settings(admin_token=TOKEN), route_state={})
    pit = tarpit(app)  # type: ignore[arg-type]
    for i in range(LIMIT):
        with pytest.raises(APIError) as refused:
            check_admin(app, "flood", f"Bearer guess-{i}")  # type: ignore[arg-type]
        assert refused.value.status == 401
    held: list[asyncio.Task[None]] = []
    while not pit.full("flood"):
        with pytest.raises(HeldError) as e:
            check_admin(app, "flood", f"Bearer guess-{len(held)}")  # type: ignore[arg-type]
        held.append(asyncio.ensure_future(e.value.hold()))
        await asyncio.sleep(0)  # the answer starts waiting
    try:
        assert len(held) == pit.queue
        for token in (TOKEN, "another-guess"):
            with pytest.raises(APIError) as refused:
                check_admin(app, "flood", f"Bearer {token}")  # type: ignore[arg-type]
            assert refused.value.status == 429
            assert not isinstance(refused.value, HeldError)  # answered at once, holding nothing
            assert "are waiting for their answers" in refused.value.message
        check_admin(app, "operator", f"Bearer {TOKEN}")  # type: ignore[arg-type]
    finally:
        for task in held:
            task.cancel()
        await asyncio.gather(*held, return_exceptions=True)
    assert not pit.full("flood")
