"""The client process's load loop, over httpx's mock transport: no sockets, no server."""

from __future__ import annotations

import asyncio
import itertools

import httpx
import pytest

from halfserve.loadtest.payload import Protocol, RequestTemplate, Signature, build_template, random_samples
from halfserve.loadtest.worker import MAX_ANSWER_BYTES, Users

SIG = Signature("features", "FP32", (3,))


def template() -> RequestTemplate:
    return build_template(Protocol.PREDICT, "m", SIG, random_samples(SIG, 4), rows_per_request=1)


def users_with(handler: httpx.MockTransport) -> Users:
    users = Users("http://127.0.0.1:1", timeout=5.0, transport=lambda: handler)
    users.add_template("infer", template())
    return users


async def test_requests_mode_sends_exactly_n_and_sorts_outcomes() -> None:
    outcomes = itertools.cycle(["ok", "ok", "503", "boom"])
    seen: list[bytes] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.content)
        kind = next(outcomes)
        if kind == "boom":
            raise httpx.ConnectError("refused", request=request)
        return httpx.Response(200 if kind == "ok" else 503, json={})

    users = users_with(httpx.MockTransport(handler))
    try:
        sample = await users.run("infer", concurrency=4, duration=None, requests=40)
    finally:
        await users.close()
    assert sample.requests == 40 == len(seen)
    assert sample.successes == 20
    assert sample.errors_by_status == {"503": 10}
    assert sample.errors_by_exception == {"ConnectError": 10}
    assert len(set(seen)) == 4  # the users cycle through the pre-encoded bodies
    assert sample.elapsed_s > 0
    assert (sample.latencies >= 0).all()


async def test_duration_mode_stops_on_time_with_one_request_in_flight_per_user() -> None:
    in_flight = 0
    peak = 0

    async def handler(request: httpx.Request) -> httpx.Response:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        await asyncio.sleep(0.005)
        in_flight -= 1
        return httpx.Response(200, json={})

    users = users_with(httpx.MockTransport(handler))
    try:
        sample = await users.run("infer", concurrency=3, duration=0.2, requests=None)
    finally:
        await users.close()
    assert peak == 3
    assert sample.elapsed_s >= 0.2
    assert sample.errors == 0
    assert sample.successes >= 3  # how many more fit in 0.2 s depends on the host
    assert len(users.clients) == 3  # one client, so one keep-alive connection, per user


async def test_exactly_one_stopping_rule() -> None:
    users = users_with(httpx.MockTransport(lambda r: httpx.Response(200)))
    try:
        with pytest.raises(ValueError, match="exactly one"):
            await users.run("infer", 1, duration=1.0, requests=5)
    finally:
        await users.close()


async def test_an_answer_declared_past_the_cap_is_an_error_unread() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"content-length": str(MAX_ANSWER_BYTES + 1)}, content=b"")

    users = users_with(httpx.MockTransport(handler))
    try:
        sample = await users.run("infer", concurrency=1, duration=None, requests=3)
    finally:
        await users.close()
    assert sample.successes == 0
    assert sample.errors_by_exception == {"AnswerTooLarge": 3}


async def test_a_request_is_bounded_as_a_whole() -> None:
    async def handler(request: httpx.Request) -> httpx.Response:
        await asyncio.sleep(3600)
        return httpx.Response(200)

    users = Users("http://127.0.0.1:1", timeout=0.05, transport=lambda: httpx.MockTransport(handler))
    users.add_template("infer", template())
    try:
        sample = await users.run("infer", concurrency=2, duration=None, requests=2)
    finally:
        await users.close()
    assert sample.errors_by_exception == {"RequestTimeout": 2}
