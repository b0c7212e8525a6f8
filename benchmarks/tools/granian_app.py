"""The app under granian (a Rust HTTP server with Python workers), to measure it against uvicorn: not a way to serve.

Two entry points, both built from ``HALFSERVE_*`` settings in the environment (``halfserve.settings.Settings``):

* ``asgi``: the whole app as ASGI. ``POST /predict`` then goes through the app's own ASGI entry
  (``halfserve.api.http.answer_first``), not the protocol's direct routes, which are uvicorn's.
* ``rsgi``: granian's own interface (RSGI) for the inference routes, their endpoint called as the protocol's direct
  routes call it (``halfserve.api.http._run``); ``GET /health`` answered at once, for the interface's own ceiling;
  anything else 404. No limits, timeouts or draining: a probe of the fastest this server's hot path could go through
  granian.

granian is not one of the project's dependencies; install it into a scratch virtual environment beside the
project (``benchmarks/results/granian-vs-uvicorn-cpu/README.md`` has the commands and the numbers)::

    granian --interface rsgi --workers 1 --loop uvloop --port 8094 --no-ws \\
      --working-dir benchmarks/tools granian_app:rsgi
"""

from __future__ import annotations

import asyncio
from typing import Any

from halfserve import logs
from halfserve.api import http
from halfserve.app import create_app
from halfserve.settings import Settings

logs.configure("text", "warning", False)
settings = Settings()
asgi = create_app(settings)


class _Rsgi:
    def __init__(self, app: http.App) -> None:
        self.app = app
        self._lifespan: Any = None

    def __rsgi_init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._lifespan = self.app.router.lifespan_context(self.app)
        loop.run_until_complete(self._lifespan.__aenter__())

    def __rsgi_del__(self, loop: asyncio.AbstractEventLoop) -> None:
        loop.run_until_complete(self._lifespan.__aexit__(None, None, None))

    async def __rsgi__(self, scope: Any, proto: Any) -> None:
        if scope.proto != "http":
            return
        if scope.method == "GET" and scope.path == "/health":
            proto.response_bytes(200, [("content-type", "application/json")], b'{"status":"ok"}')
            return
        asgi_scope: dict[str, Any] = {
            "type": "http",
            "method": scope.method,
            "path": scope.path,
            "raw_path": scope.path.encode(),
            "root_path": "",
            "query_string": scope.query_string.encode(),
            "headers": [(k.encode(), v.encode()) for k, v in scope.headers.items()],
            "http_version": "1.1",
            "scheme": "http",
            "client": None,
            "server": None,
            "state": {},
        }
        found = http.hot_route(asgi_scope) if scope.method == "POST" else None
        if found is None:
            proto.response_bytes(404, [], b"")
            return
        body = await proto()

        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": body, "more_body": False}

        response = await http._run(self.app, *found, asgi_scope, receive)
        headers = [(k.decode(), v.decode()) for k, v in response.raw_headers]
        proto.response_bytes(response.status_code, headers, bytes(response.body))


rsgi = _Rsgi(asgi)
