"""The management API in-process: precision switches under traffic, load / unload / reload of versions, readiness."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from halfserve import storage
from halfserve.api.http import ROUTE_ONLY
from halfserve.errors import ModelNotReadyError
from halfserve.settings import Settings
from tests.conftest import save_tiny_mlp
from tests.integration.conftest import serving
from tests.waiting import DEADLINE_S, until

TOKEN = "management-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
SAMPLE = {"model": "tiny", "inputs": [[0.5] * 16, [-0.25] * 16]}


def settings(root: Path, **kw: object) -> Settings:
    return Settings(store=root, admin_token=TOKEN, **kw)


async def switch(client: httpx.AsyncClient, precision: str) -> dict[str, object]:
    r = await client.post("/models/tiny/precision", json={"precision": precision}, headers=AUTH)
    assert r.status_code == 200, r.text
    listing: dict[str, object] = r.json()
    return listing


async def test_switching_to_fp32_and_back_under_traffic_fails_no_request(tiny_store: Path) -> None:
    async with serving(settings(tiny_store, precision="fp16", max_delay_ms=1)) as client:
        stop = asyncio.Event()
        answers: list[httpx.Response] = []

        async def traffic() -> None:
            while not stop.is_set():
                answers.append(await client.post("/predict", json=SAMPLE))

        async def answered(more: int) -> None:
            target = len(answers) + more
            await until(lambda: len(answers) >= target, f"{more} more answers (traffic stalled?)", every=0.005)

        senders = [asyncio.create_task(traffic()) for _ in range(8)]
        try:
            await answered(20)
            fp32 = await switch(client, "fp32")
            await answered(20)
            back = await switch(client, "fp16")
            await answered(20)
        finally:
            stop.set()
            await asyncio.gather(*senders)
        stats = (await client.get("/models/tiny/stats")).json()

    assert [r.status_code for r in answers if r.status_code != 200] == []
    precisions = [r.json()["precision"] for r in answers]
    assert {"fp16", "fp32"} <= set(precisions)
    # In order: fp16 before the first switch, fp32 in between, fp16 again at the end.
    assert precisions[0] == precisions[-1] == "fp16"
    first32 = precisions.index("fp32")
    assert "fp16" in precisions[first32:]
    assert (fp32["precision"], fp32["weight_dtype"]) == ("fp32", "float32")
    assert (back["precision"], back["weight_dtype"]) == ("fp16", "float16")
    assert back["weight_bytes"] * 2 == fp32["weight_bytes"] == back["host_fp32_bytes"]
    assert stats["succeeded"] == len(answers)
    assert stats["failed"] == 0


async def test_precision_switch_uses_the_host_weights_not_the_checkpoint(tiny_store: Path) -> None:
    x = np.random.default_rng(0).standard_normal((4, 16)).astype(np.float32)
    async with serving(settings(tiny_store, precision="bf16")) as client:
        half = (await client.post("/predict", json={"inputs": x.tolist()})).json()
        (tiny_store / "tiny" / "1" / storage.WEIGHTS).write_bytes(b"not a checkpoint any more")
        await switch(client, "fp32")
        full = (await client.post("/predict", json={"inputs": x.tolist()})).json()
        again = await switch(client, "fp32")  # already fp32: nothing to do
    assert (half["precision"], full["precision"], again["precision"]) == ("bf16", "fp32", "fp32")
    np.testing.assert_allclose(np.array(full["outputs"]), np.array(half["outputs"]), atol=0.1)
    assert full["outputs"] != half["outputs"]


async def test_load_a_version_unload_and_reload_without_restart(tmp_path: Path) -> None:
    save_tiny_mlp(tmp_path, seed=0)
    save_tiny_mlp(tmp_path, seed=1)  # version 2, other weights: the highest is served
    async with serving(settings(tmp_path, precision="fp32")) as client:
        v2 = (await client.post("/predict", json=SAMPLE)).json()
        r = await client.post("/models/tiny/load", json={"version": 1, "precision": "bf16"}, headers=AUTH)
        assert r.status_code == 200, r.text
        assert (r.json()["version"], r.json()["precision"], r.json()["state"]) == (1, "bf16", "ready")
        v1 = (await client.post("/predict", json=SAMPLE)).json()

        r = await client.post("/models/tiny/unload", headers=AUTH)
        assert (r.status_code, r.json()["state"]) == (200, "unloaded")
        gone = await client.post("/predict", json=SAMPLE)
        model_ready = await client.get("/v2/models/tiny/ready")

        r = await client.post("/models/tiny/reload", headers=AUTH)
        assert r.status_code == 200, r.text
        reloaded = (await client.post("/predict", json=SAMPLE)).json()
        listing = (await client.get("/models")).json()["models"][0]
    assert (v2["version"], v1["version"], reloaded["version"]) == (2, 1, 1)
    assert v1["outputs"] != v2["outputs"]
    assert gone.status_code == 503
    assert "unloaded" in gone.json()["error"]
    assert model_ready.status_code == 400
    # The precision given at load time sticks across the reload.
    assert (reloaded["precision"], listing["precision"], listing["state"]) == ("bf16", "bf16", "ready")


async def test_readiness_reflects_a_model_loading_and_warming_up(tiny_store: Path) -> None:
    async with serving(settings(tiny_store)) as client:
        assert (await client.post("/models/tiny/unload", headers=AUTH)).status_code == 200
        loading = asyncio.create_task(client.post("/models/tiny/load", headers=AUTH))
        seen: list[tuple[int, int, int]] = []
        deadline = time.monotonic() + DEADLINE_S
        while not loading.done():
            assert time.monotonic() < deadline, "the load never finished"
            seen.append(
                (
                    (await client.get("/ready")).status_code,
                    (await client.get("/v2/health/ready")).status_code,
                    (await client.get("/v2/models/tiny/ready")).status_code,
                )
            )
            await asyncio.sleep(0.001)  # in-process requests never yield to the loop by themselves
        assert (await loading).status_code == 200
        after = (
            (await client.get("/ready")).status_code,
            (await client.get("/v2/models/tiny/ready")).status_code,
        )
    assert (503, 400, 400) in seen, seen
    assert after == (200, 200)


async def test_a_failed_load_leaves_the_served_model_alone(tiny_store: Path) -> None:
    async with serving(settings(tiny_store)) as client:
        (tiny_store / "tiny" / "1" / storage.WEIGHTS).write_bytes(b"broken")
        r = await client.post("/models/tiny/reload", headers=AUTH)
        still = await client.post("/predict", json=SAMPLE)
        ready = await client.get("/ready")
    assert r.status_code == 400
    assert "safetensors" in r.json()["error"]
    assert still.status_code == 200
    assert ready.status_code == 200


@pytest.mark.parametrize(
    ("path", "body", "status", "error"),
    [
        ("/models/tiny/precision", {"precision": "fp8"}, 400, "precision: expected one of"),
        ("/models/tiny/precision", {}, 400, "precision: expected one of"),
        ("/models/nope/precision", {"precision": "fp32"}, 404, "unknown model"),
        ("/models/tiny/load", {"version": 7}, 404, "no version 7"),
        ("/models/tiny/load", {"version": True}, 400, "version: expected a positive integer"),
        ("/models/tiny/load", {"version": "\u0661"}, 400, "version: expected a positive integer"),
        # As V2's and TorchServe's routes spell versions: "01" had been taken for 1 here, an unknown version there.
        ("/models/tiny/load", {"version": "01"}, 400, 'version: expected a positive integer, got "01"'),
        ("/models/tiny/unload", {"x": 1}, 400, "body: unknown key 'x'; this call takes none"),  # had been ignored
        ("/models/tiny/load", {"foo": 1}, 400, "body: unknown key 'foo'; this call takes 'version' and 'precision'"),
        ("/models/tiny/load", {"version": 1, "precison": "fp32"}, 400, "body: unknown key 'precison'"),
        ("/models/tiny/reload", {"version": 1}, 400, "body: unknown key 'version'; this call takes 'precision'"),
        ("/models/tiny/precision", {"precision": "fp32", "x": 0}, 400, "body: unknown key 'x'"),
        ("/models/nope/load", {}, 404, "not in the store"),
        ("/models/bad%20name/load", {}, 400, "invalid"),
        ("/models/nope/reload", {}, 404, "unknown model"),
        ("/models/nope/unload", {}, 404, "unknown model"),
    ],
)
async def test_management_errors_name_the_problem(
    tiny_store: Path, path: str, body: dict[str, object], status: int, error: str
) -> None:
    async with serving(settings(tiny_store)) as client:
        r = await client.post(path, json=body, headers=AUTH)
    assert r.status_code == status, r.text
    assert error in r.json()["error"]


@pytest.mark.parametrize(
    ("body", "said"),
    [
        (b'{"version": 1e23}', "1e+23"),
        (b'{"version": true}', "true"),
        (b'{"version": [1]}', "[1]"),
        (b'{"version": 1.5}', "1.5"),
    ],
)
async def test_a_version_that_is_no_positive_integer_is_named_in_json(tiny_store: Path, body: bytes, said: str) -> None:
    """In JSON's words (``true``, ``[1]``), not Python's (``True``); a number as JSON spells it (``1e+23``)."""
    async with serving(settings(tiny_store)) as client:
        r = await client.post("/models/tiny/load", content=body, headers={**AUTH, "content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"] == f"version: expected a positive integer, got {said}"


async def test_switching_an_unloaded_model_is_a_conflict(tiny_store: Path) -> None:
    async with serving(settings(tiny_store)) as client:
        await client.post("/models/tiny/unload", headers=AUTH)
        r = await client.post("/models/tiny/precision", json={"precision": "fp32"}, headers=AUTH)
    assert r.status_code == 409
    assert "load it first" in r.json()["error"]


async def test_management_needs_the_admin_token(tiny_store: Path) -> None:
    async with serving(settings(tiny_store)) as client:
        missing = await client.post("/models/tiny/precision", json={"precision": "fp32"})
        wrong = await client.post("/models/tiny/unload", headers={"Authorization": "Bearer nope"})
        listing = (await client.get("/models")).json()["models"][0]
    async with serving(Settings(store=tiny_store)) as client:
        off = await client.post("/models/tiny/reload", headers=AUTH)
    assert (missing.status_code, wrong.status_code, off.status_code) == (401, 401, 403)
    assert listing["state"] == "ready"


async def test_a_front_end_asking_which_route_takes_a_request_runs_none(tiny_store: Path) -> None:
    """A front-end asks the engine process which route takes a request whose body is past its relay cap, without the
    body (:data:`ROUTE_ONLY`): the answer runs no route (an unload would have unloaded the model), and where no route
    takes the request it is the router's own, as with the body."""
    asking = {ROUTE_ONLY.decode(): "1", **AUTH}
    async with serving(settings(tiny_store), peer=None) as client:
        unload = await client.post("/models/tiny/unload", headers=asking)
        listing = (await client.get("/models")).json()["models"][0]
        nowhere = await client.post("/nonexistent", headers=asking)
        verb = await client.post("/v1/models/tiny:frobnicate", headers=asking)
    assert (unload.status_code, unload.headers[ROUTE_ONLY.decode()], unload.content) == (204, "routed", b"")
    assert listing["state"] == "ready"
    assert (nowhere.status_code, nowhere.json()) == (404, {"error": "Not Found"})
    assert verb.status_code == 404
    assert "no verb ':frobnicate' here" in verb.json()["error"]


async def test_a_client_cannot_ask_which_route_takes_its_request(tiny_store: Path) -> None:
    async with serving(settings(tiny_store)) as client:  # a client with an address: not the relay
        unload = await client.post("/models/tiny/unload", headers={ROUTE_ONLY.decode(): "1", **AUTH})
    assert (unload.status_code, unload.json()["state"]) == (200, "unloaded")


async def test_a_request_that_looked_the_model_up_before_a_reload_is_answered_by_the_new_load(tiny_store: Path) -> None:
    # A route looks the model up, then (a text tokenized off the event loop) submits: a reload can swap in between.
    from halfserve.app import create_app

    app = create_app(settings(tiny_store, precision="fp32"))
    async with app.router.lifespan_context(app):
        repo = app.state.serving.repository
        await until(lambda: repo.ready, "the model loading")
        looked_up = repo.get("tiny")
        again = await repo.reload("tiny")
        assert again is not looked_up
        assert looked_up.batcher is None  # released
        x = np.ones((1, 16), dtype=np.float32)
        answer = await looked_up.submit({looked_up.manifest.inputs[0].name: x})
        want = await again.submit({again.manifest.inputs[0].name: x})
        np.testing.assert_array_equal(answer.outputs["logits"], want.outputs["logits"])
        await repo.unload("tiny")
        with pytest.raises(ModelNotReadyError, match="unloaded"):
            again.submit({again.manifest.inputs[0].name: x})


async def test_an_unforeseen_failure_of_a_route_is_answered_as_json(
    tiny_store: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The process's open files running out under a reload (its store read fails with EMFILE) had been answered by
    Starlette's last resort, a plain-text 500: now the API's JSON, the exception still logged."""
    from halfserve.api.http import management
    from halfserve.app import create_app

    async def out_of_files(*args: object, **kwargs: object) -> object:
        raise OSError(24, "Too many open files")

    app = create_app(settings(tiny_store))
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=transport, base_url="http://localhost") as client,
    ):
        deadline = time.monotonic() + DEADLINE_S
        while (await client.get("/ready")).status_code != 200:
            assert time.monotonic() < deadline, "not ready"
            await asyncio.sleep(0.05)
        monkeypatch.setattr(management, "load_from_store", out_of_files)
        r = await client.post("/models/tiny/reload", headers={**AUTH, "X-Request-Id": "reload-1"})
        assert (await client.get("/health")).status_code == 200
    assert r.headers["x-request-id"] == "reload-1"  # as every other answer carries it
    assert r.status_code == 500
    assert r.json() == {"error": "internal error: OSError: [Errno 24] Too many open files"}
