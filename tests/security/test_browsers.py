"""A web page cannot make its visitors' browsers use the server: inference bodies must be JSON or binary, browsers'
cross-origin requests that could run or change something are refused, and a name rebound to the server's address
reads nothing (only addresses, localhost and ``allowed_hosts`` are answered). Programs that send none of a browser's
headers are served as before."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from halfserve.settings import Settings
from tests.conftest import save_tiny_mlp
from tests.integration.conftest import serving
from tests.integration.test_limits import HEADER, INFER, ROW

TOKEN = "browser-tests-admin-token"
JSON_BODY = b'{"inputs": [[' + b",".join(b"0.25" for _ in ROW) + b"]]}"


@pytest.fixture
def store(tmp_path: Path) -> Path:
    save_tiny_mlp(tmp_path)
    return tmp_path


@pytest.mark.parametrize(
    ("content_type", "status"),
    [
        ("text/plain", 415),
        ("text/plain;charset=UTF-8", 415),
        ("application/x-www-form-urlencoded", 415),
        ("multipart/form-data; boundary=x", 415),
        ("application/json", 200),
        ("Application/JSON; charset=utf-8", 200),
        ("application/vnd.example+json", 200),
        (None, 200),  # tritonclient sends no Content-Type
    ],
)
async def test_inference_bodies_must_be_json_when_they_say_what_they_are(
    store: Path, content_type: str | None, status: int
) -> None:
    headers = {} if content_type is None else {"Content-Type": content_type}
    v2_body = (
        b'{"inputs": [{"name": "features", "shape": [1, 16], "datatype": "FP32", "data": ['
        + b",".join(b"0.25" for _ in ROW)
        + b"]}]}"
    )
    async with serving(Settings(store=store)) as client:
        predict = await client.post("/predict", content=JSON_BODY, headers=headers)
        v2 = await client.post(INFER, content=v2_body, headers=headers)
        stats = (await client.get("/models/tiny/stats")).json()
    for r in (predict, v2):
        assert r.status_code == status, r.text
        if status == 415:
            assert r.json()["error"].startswith(f"Content-Type: {content_type!r} is not accepted here; send ")
    assert stats["requests"] == (2 if status == 200 else 0)  # a refused body never reaches the model


async def test_binary_tensor_data_may_say_octet_stream_on_v2_only(store: Path) -> None:
    raw = np.zeros((2, 16), np.float32).tobytes()
    octet = {HEADER: "0", "Content-Type": "application/octet-stream"}
    async with serving(Settings(store=store)) as client:
        v2 = await client.post(INFER, content=raw, headers=octet)
        predict = await client.post("/predict", content=JSON_BODY, headers={"Content-Type": "application/octet-stream"})
    assert v2.status_code == 200, v2.text
    assert predict.status_code == 415
    assert predict.json()["error"] == (
        "Content-Type: 'application/octet-stream' is not accepted here; send application/json"
    )


@pytest.mark.parametrize(
    ("headers", "status"),
    [
        ({"Sec-Fetch-Site": "cross-site"}, 403),
        ({"Sec-Fetch-Site": "same-site"}, 403),
        ({"Sec-Fetch-Site": "same-origin", "Origin": "http://localhost"}, 200),
        ({"Sec-Fetch-Site": "none"}, 200),
        ({"Origin": "http://evil.example"}, 403),
        ({"Origin": "null"}, 403),
        ({"Origin": "http://localhost"}, 200),  # an older browser on the server's own page (its Host)
        ({}, 200),
    ],
)
async def test_cross_origin_requests_from_browsers_are_refused(
    store: Path, headers: dict[str, str], status: int
) -> None:
    auth = {"Authorization": f"Bearer {TOKEN}"}
    async with serving(Settings(store=store, admin_token=TOKEN)) as client:  # type: ignore[arg-type]
        predict = await client.post("/predict", content=JSON_BODY, headers={**headers, "Content-Type": "text/plain"})
        predict_json = await client.post("/predict", content=JSON_BODY, headers=headers)
        reload = await client.post("/models/tiny/reload", headers={**headers, **auth})
        listing = await client.get("/models", headers=headers)  # a page cannot read the answer: served
    assert predict.status_code == (status if status == 403 else 415)
    assert predict_json.status_code == status, predict_json.text
    assert reload.status_code == status, reload.text
    assert listing.status_code == 200
    if status == 403:
        assert predict_json.json()["error"].startswith(("Sec-Fetch-Site:", "Origin:"))
        assert "refused" in predict_json.json()["error"]


async def test_a_rebound_name_gets_nothing_by_default_but_addresses_and_localhost_do(store: Path) -> None:
    """DNS rebinding: a page of the attacker's name, rebound to 127.0.0.1, is same-origin to the browser, which sends
    the attacker's name as the Host. By default only IP addresses, localhost and the name the server binds to are
    answered (the probes whatever the Host); ``*`` answers any."""
    rebound = {"Host": "rebound.example", "Sec-Fetch-Site": "same-origin"}
    async with serving(Settings(store=store, host="gpu-1.lan")) as client:
        predict = await client.post("/predict", content=JSON_BODY, headers=rebound)
        listing = await client.get("/models", headers=rebound)
        served = [
            await client.post("/predict", content=JSON_BODY, headers={"Host": host})
            for host in ("localhost", "LOCALHOST:8000", "app.localhost", "127.0.0.1:8000", "10.1.2.3", "[::1]:8000")
        ]
        bound = await client.get("/models", headers={"Host": "gpu-1.lan:8000"})
        probes = [await client.get(path, headers=rebound) for path in ("/health", "/ready", "/v2/health/ready")]
        no_host = await client.get("/models", headers={"Host": ""})
    for r in (predict, listing, no_host):
        assert r.status_code == 400, r.text
        assert r.json()["error"].endswith("is not a name this server answers to (allowed_hosts)")
    assert predict.json()["error"] == "Host: 'rebound.example' is not a name this server answers to (allowed_hosts)"
    assert [r.status_code for r in served] == [200] * 6
    assert bound.status_code == 200
    assert [r.status_code for r in probes] == [200] * 3
    async with serving(Settings(store=store, allowed_hosts=["*"])) as client:
        assert (await client.post("/predict", content=JSON_BODY, headers=rebound)).status_code == 200


async def test_allowed_hosts_add_names_and_refuse_others_but_not_probes(
    store: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HALFSERVE_ALLOWED_HOSTS", "api.example.com, *.internal")
    settings = Settings(store=store)
    assert settings.allowed_hosts == ["api.example.com", "*.internal"]
    async with serving(settings) as client:
        rebound = await client.get("/metrics", headers={"Host": "rebound.evil.example"})
        predict = await client.post("/predict", content=JSON_BODY, headers={"Host": "rebound.evil.example:8000"})
        served = [
            await client.get("/models", headers={"Host": host})
            for host in ("api.example.com", "API.example.com:8000", "gpu-1.internal", "a.b.internal:80", "localhost")
        ]
        probes = [
            await client.get(path, headers={"Host": "rebound.evil.example"}) for path in ("/ready", "/v2/health/live")
        ]
        suffix_only = await client.get("/models", headers={"Host": "internal"})
    for r in (rebound, predict, suffix_only):
        assert r.status_code == 400
        assert r.json()["error"].endswith("is not a name this server answers to (allowed_hosts)")
    assert rebound.json()["error"].startswith("Host: 'rebound.evil.example' ")
    assert [r.status_code for r in served] == [200] * 5
    assert [r.status_code for r in probes] == [200, 200]
