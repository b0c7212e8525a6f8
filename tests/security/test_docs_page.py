"""``/docs`` runs no third-party file the server did not pin: Swagger UI at one exact release, each file with its
subresource-integrity hash; ``--no-docs`` takes the page away and leaves the schema."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from halfserve.api.http.docs import INTEGRITY, SWAGGER_UI_VERSION
from halfserve.settings import Settings
from tests.conftest import save_tiny_mlp
from tests.integration.conftest import serving


@pytest.fixture
def store(tmp_path: Path) -> Path:
    save_tiny_mlp(tmp_path)
    return tmp_path


async def test_every_remote_file_of_the_docs_page_is_pinned_with_its_hash(store: Path) -> None:
    async with serving(Settings(store=store)) as client:
        page = await client.get("/docs")
        schema = await client.get("/openapi.json")
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
    html = page.text
    tags = re.findall(r"<(?:script|link)\b[^>]*>", html)
    remote = [t for t in tags if re.search(r'(?:src|href)="https?://', t)]
    assert len(remote) == 2, tags  # the stylesheet and the script
    for tag in remote:
        url = re.search(r'(?:src|href)="([^"]+)"', tag)
        assert url is not None
        assert f"swagger-ui-dist@{SWAGGER_UI_VERSION}/" in url.group(1)
        assert re.fullmatch(r"\d+\.\d+\.\d+", SWAGGER_UI_VERSION)  # an exact release, not a floating major
        name = url.group(1).rsplit("/", 1)[1]
        assert f'integrity="{INTEGRITY[name]}"' in tag
        assert re.fullmatch(r"sha384-[A-Za-z0-9+/]{64}", INTEGRITY[name])
        assert 'crossorigin="anonymous"' in tag
    assert "http" not in "".join(t for t in tags if t not in remote)  # nothing else from anywhere
    assert schema.status_code == 200


@pytest.mark.skipif(shutil.which("node") is None, reason="needs node to run the page's script")
async def test_the_page_script_points_swagger_ui_at_the_schema(store: Path) -> None:
    async with serving(Settings(store=store)) as client:
        html = (await client.get("/docs")).text
    inline = re.findall(r"<script>([\s\S]*?)</script>", html)
    assert len(inline) == 1
    run = (
        "let seen; globalThis.SwaggerUIBundle = Object.assign((c) => { seen = c; },"
        " {presets: {apis: 'apis'}, SwaggerUIStandalonePreset: 'standalone'});\n"
        + inline[0]
        + "\nprocess.stdout.write(JSON.stringify(seen));"
    )
    out = subprocess.run(["node", "-e", run], capture_output=True, text=True, timeout=30, check=True).stdout
    config = json.loads(out)
    assert config["url"] == "/openapi.json"
    assert config["dom_id"] == "#swagger-ui"
    assert config["presets"] == ["apis", "standalone"]


async def test_no_docs_takes_the_page_away_and_leaves_the_schema(store: Path) -> None:
    async with serving(Settings(store=store, docs=False)) as client:
        docs = await client.get("/docs")
        redoc = await client.get("/redoc")
        schema = await client.get("/openapi.json")
    assert docs.status_code == redoc.status_code == 404
    assert schema.status_code == 200
    assert "/predict" in schema.json()["paths"]
