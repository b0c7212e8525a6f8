from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import httpx

from halfserve.app import create_app
from halfserve.settings import Settings


@contextlib.asynccontextmanager
async def serving(settings: Settings) -> AsyncIterator[httpx.AsyncClient]:
    """The app in-process with its lifespan, through httpx's ASGI transport, once ``/ready`` answers 200."""
    app = create_app(settings)
    transport = httpx.ASGITransport(app=app)
    client = httpx.AsyncClient(transport=transport, base_url="http://localhost")
    async with app.router.lifespan_context(app), client:
        for _ in range(600):
            if (await client.get("/ready")).status_code == 200:
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError(f"not ready: {(await client.get('/ready')).text}")
        yield client
