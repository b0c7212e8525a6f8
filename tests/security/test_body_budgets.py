"""Management calls read at most 64 KiB of body, and only once the admin token is checked; inference JSON is held to
max_json_values, counted before parsing, whatever its compression."""

from __future__ import annotations

import gzip
from pathlib import Path

from halfserve.settings import Settings
from tests.integration.conftest import serving

TOKEN = "body-budget-admin-token"


async def test_a_management_body_over_64_kib_is_a_413_and_unauthenticated_ones_are_not_read(tiny_store: Path) -> None:
    big = b'{"parameters": {"pad": "' + b"x" * (80 << 10) + b'"}}'
    async with serving(Settings(store=tiny_store, admin_token=TOKEN)) as client:
        load = "/v2/repository/models/tiny/load"
        anonymous = await client.post(load, content=big, headers={"content-type": "application/json"})
        authorised = await client.post(load, content=big, headers={"Authorization": f"Bearer {TOKEN}"})
        inflated = await client.post(
            load,
            content=gzip.compress(big),
            headers={"Authorization": f"Bearer {TOKEN}", "content-encoding": "gzip"},
        )
        small = await client.post(load, json={}, headers={"Authorization": f"Bearer {TOKEN}"})
    assert anonymous.status_code == 401
    assert authorised.status_code == 413
    assert (
        authorised.json()["error"]
        == f"body: {len(big)} bytes exceed the limit of 65536 bytes (a management call's limit)"
    )
    assert inflated.status_code == 413
    assert inflated.json()["error"] == "body: decompresses to more than 65536 bytes (a management call's limit)"
    assert small.status_code == 200, small.text


async def test_json_values_are_counted_against_the_setting_on_both_apis(tiny_store: Path) -> None:
    rows = [[0.25] * 16] * 70  # 70 lists + 70 x 15 commas + 69 commas + the envelope: about 1,190
    v2 = {"inputs": [{"name": "features", "datatype": "FP32", "shape": [70, 16], "data": rows}]}
    async with serving(Settings(store=tiny_store, max_json_values=1024, max_request_rows=70)) as client:
        over = await client.post("/predict", json={"inputs": rows})
        over_v2 = await client.post("/v2/models/tiny/infer", json=v2)
        under = await client.post("/predict", json={"inputs": rows[:60]})
    for r in (over, over_v2):
        assert r.status_code == 413, r.text
        assert r.json()["error"].startswith("body: JSON with more than 1024 values and containers (max_json_values)")
    assert under.status_code == 200, under.text


async def test_a_header_length_of_thousands_of_digits_is_a_400(tiny_store: Path) -> None:
    """Past 4,300 digits Python's int() raises: that was a 500 with a traceback."""
    async with serving(Settings(store=tiny_store)) as client:
        r = await client.post(
            "/v2/models/tiny/infer",
            content=b"{}",
            headers={"Inference-Header-Content-Length": "9" * 5000, "content-type": "application/json"},
        )
    assert r.status_code == 400
    assert r.json()["error"].startswith("Inference-Header-Content-Length: expected a non-negative integer")
