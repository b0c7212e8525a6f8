"""Names and versions from URLs never reach outside the store; management calls need the admin token."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import unquote

import pytest

from halfserve.settings import Settings
from tests.conftest import save_tiny_mlp
from tests.integration.conftest import serving

TOKEN = "security-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}

ESCAPES = [
    "..",
    "%2e%2e",
    "%2E%2E",
    "..%2F..%2Fetc%2Fpasswd",
    "%2e%2e%2f%2e%2e%2fetc",
    "%2Fetc%2Fpasswd",
    "%2F",
    "tiny%0A",
    "tiny%00",
    "%5C..%5Cwindows",
]


@pytest.fixture
def store_with_a_secret_outside(tmp_path: Path) -> Path:
    root = tmp_path / "store"
    save_tiny_mlp(root)
    # A model-shaped folder next to the store: reaching it would mean a name escaped the store.
    save_tiny_mlp(tmp_path, "outside")
    return root


async def asgi_status(app: Any, method: str, raw_path: str, headers: dict[str, str] | None = None) -> int:
    """The status ``app`` answers for ``raw_path`` exactly as a server would hand it over (an HTTP client would
    resolve ``..`` segments before sending)."""
    status = 0

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": unquote(raw_path),
        "raw_path": raw_path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(k.lower().encode(), v.encode()) for k, v in ({"Host": "127.0.0.1", **(headers or {})}).items()]
        + [(b"content-type", b"application/json")],
        "server": ("test", 80),
        "client": ("127.0.0.1", 1),
    }
    await app(scope, receive, send)
    return status


@pytest.mark.parametrize("escape", ESCAPES)
async def test_versions_in_v2_urls_cannot_name_anything_but_the_served_version(
    store_with_a_secret_outside: Path, escape: str
) -> None:
    async with serving(Settings(store=store_with_a_secret_outside)) as client:
        app = client._transport.app  # type: ignore[attr-defined]
        for method, suffix in [
            ("GET", ""),
            ("GET", "/ready"),
            ("GET", "/config"),
            ("GET", "/stats"),
            ("POST", "/infer"),
        ]:
            status = await asgi_status(app, method, f"/v2/models/tiny/versions/{escape}{suffix}")
            assert status in (404, 405), (method, escape, suffix, status)
        assert await asgi_status(app, "GET", "/v2/models/tiny/versions/1") == 200


@pytest.mark.parametrize("escape", [*ESCAPES, "..%2Foutside", "%2e%2e%2Foutside"])
async def test_repository_load_cannot_load_from_outside_the_store(
    store_with_a_secret_outside: Path, escape: str
) -> None:
    settings = Settings(store=store_with_a_secret_outside, admin_token=TOKEN)
    async with serving(settings) as client:
        app = client._transport.app  # type: ignore[attr-defined]
        load = await asgi_status(app, "POST", f"/v2/repository/models/{escape}/load", AUTH)
        unload = await asgi_status(app, "POST", f"/v2/repository/models/{escape}/unload", AUTH)
        names = [m["name"] for m in (await client.get("/models")).json()["models"]]
        assert await asgi_status(app, "POST", "/v2/repository/models/tiny/load", AUTH) == 200
    assert load in (400, 404, 405), escape
    assert unload in (400, 404, 405), escape
    assert names == ["tiny"]


async def test_management_calls_answer_only_to_the_configured_token(tiny_store: Path) -> None:
    async with serving(Settings(store=tiny_store, admin_token=TOKEN)) as client:
        for headers in (
            {},
            {"Authorization": "Bearer"},
            {"Authorization": f"Bearer {TOKEN}x"},
            {"Authorization": f"Bearer {TOKEN[:-1]}"},
            {"Authorization": f"Token {TOKEN}"},
        ):
            r = await client.post("/v2/repository/models/tiny/unload", headers=headers)
            assert r.status_code == 401, (headers, r.text)
        assert (await client.get("/v2/models/tiny/ready")).status_code == 200  # still loaded
    async with serving(Settings(store=tiny_store)) as client:
        r = await client.post("/v2/repository/models/tiny/unload", headers=AUTH)
        assert r.status_code == 403
        assert (await client.get("/v2/models/tiny/ready")).status_code == 200


async def test_a_trailing_slash_is_not_found_rather_than_redirected_to_the_clients_host(tiny_store: Path) -> None:
    host = {"Host": "10.9.9.9:1"}
    async with serving(Settings(store=tiny_store)) as client:
        for method, path, same_family in [
            ("PUT", "/predictions/tiny/", "/predictions/tiny/1/x/y"),
            ("POST", "/v1/models/tiny:predict/", "/v1/models/tiny:predict/x"),
            ("GET", "/ping/", "/pingx"),
            ("GET", "/models/tiny/", "/models/tiny/1/x/y"),
            ("POST", "/v2/models/tiny/infer/", "/v2/models/tiny/infer/x"),
        ]:
            r = await client.request(method, path, headers=host, content=b"{}")
            assert r.status_code == 404, (path, r.status_code, r.headers)
            assert "location" not in r.headers
            unrouted = await client.request(method, same_family, headers=host, content=b"{}")
            assert r.json() == unrouted.json(), path  # the route family's own wording
        assert (await client.put("/predictions/tiny", content=b"{}")).status_code != 404
