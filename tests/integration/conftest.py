from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import httpx

from halfserve.app import create_app
from halfserve.settings import Settings

READY_DEADLINE_S = 240.0
"""How long the app may take to load its models: a hang, not a slow host. Loading compiles (inductor) and, with
instance processes, starts each process and compiles there too; a loaded 2-core host took over 30 s for that. Within
the suite's 300 s per test."""


@contextlib.asynccontextmanager
async def serving(
    settings: Settings, peer: tuple[str, int] | None = ("127.0.0.1", 123)
) -> AsyncIterator[httpx.AsyncClient]:
    """The app in-process with its lifespan, through httpx's ASGI transport, once ``/ready`` answers 200; requests
    come from ``peer`` (None: no address, as on the front-ends' relay socket)."""
    app = create_app(settings)
    transport = httpx.ASGITransport(app=app, client=peer)  # type: ignore[arg-type]
    client = httpx.AsyncClient(transport=transport, base_url="http://localhost")
    async with app.router.lifespan_context(app), client:
        deadline = time.monotonic() + READY_DEADLINE_S
        while (await client.get("/ready")).status_code != 200:
            if time.monotonic() > deadline:
                raise AssertionError(f"not ready within {READY_DEADLINE_S:g} s: {(await client.get('/ready')).text}")
            await asyncio.sleep(0.05)
        yield client
