"""Live fidelity on a real server in-process: a classifier that meets its bar at load on its calibration samples, then
gets traffic on which bf16 flips its top classes, is demoted to fp32 within its window while concurrent requests are
all answered; alert-only mode keeps it in bf16; rate 0 samples nothing."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from halfserve import cli, models
from halfserve.manifest import Precision
from halfserve.settings import LiveFidelityAction, Settings
from tests.integration.conftest import serving
from tests.waiting import DEADLINE_S

FEATURES = 16
CLASSES = 10
LINEAR = {"in_features": FEATURES, "hidden": [], "out_features": CLASSES}
WINDOW = 20
TOKEN = "live-fidelity-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
SHIFT = 100.0
"""The drifted traffic's first feature: every class weighs it 1000, so each score gains 1e5, where bf16 resolves
steps of 512 and the classes' own parts (a few units) vanish."""


def drifting_classifier(root: Path) -> tuple[Path, np.ndarray]:
    """A linear classifier whose classes all weigh the first feature alike (1000) and the others each their own way,
    imported with calibration samples whose first feature is 0 (and whose top two classes are well apart): bf16
    agrees with fp32 on them, and on nothing once the first feature is large. Returns the store and the samples."""
    torch.manual_seed(0)
    module = models.build("mlp", **LINEAR)
    w = torch.randn(CLASSES, FEATURES)
    w[:, 0] = 1000.0
    with torch.no_grad():
        module.net[0].weight.copy_(w)
        module.net[0].bias.zero_()
    torch.save(module.state_dict(), root / "drift.pth")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(512, FEATURES)).astype(np.float32)
    x[:, 0] = 0.0
    scores = np.sort(x @ w.numpy().T, axis=1)
    clear = x[(scores[:, -1] - scores[:, -2]) > 0.1 * np.abs(scores[:, -1])][:64]
    np.save(root / "calib.npy", clear)
    args = ["import", str(root / "drift.pth"), "--store", str(root / "store"), "--name", "drift"]
    args += ["--architecture", "mlp", "--arch-kwargs", json.dumps(LINEAR), "--input", f"x:{FEATURES}"]
    assert cli.main([*args, "--device", "cpu", "--calibration", str(root / "calib.npy")]) == 0
    return root / "store", clear


@pytest.fixture(scope="module")
def drift_store(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, np.ndarray]:
    return drifting_classifier(tmp_path_factory.mktemp("drift"))


def live_settings(store: Path, **given: object) -> Settings:
    fields: dict[str, object] = {
        "store": store,
        "precision": Precision.BF16,
        "live_fidelity_rate": 1.0,
        "live_fidelity_cpu_share": 1.0,
        "live_fidelity_window": WINDOW,
        "live_fidelity_min_rows": WINDOW,
        "admin_token": TOKEN,
    }
    fields.update(given)
    return Settings(**fields)  # type: ignore[arg-type]


async def listing(client: httpx.AsyncClient) -> dict[str, object]:
    body = (await client.get("/models")).json()
    listed: list[dict[str, object]] = body["models"] if isinstance(body, dict) else body
    return next(m for m in listed if m["name"] == "drift")


async def live(client: httpx.AsyncClient) -> dict[str, object]:
    found = (await listing(client))["live_fidelity"]
    assert isinstance(found, dict)
    return found


async def metric(client: httpx.AsyncClient, series: str) -> float | None:
    text = (await client.get("/metrics")).text
    line = next((line for line in text.splitlines() if line.startswith(series + " ")), None)
    return None if line is None else float(line.removeprefix(series + " "))


async def burst(client: httpx.AsyncClient, rows: np.ndarray, requests: int = 16) -> list[int]:
    """``requests`` concurrent requests, each a row of ``rows``; their statuses."""
    sent = [client.post("/predict", json={"inputs": [rows[i % len(rows)].tolist()]}) for i in range(requests)]
    return [r.status_code for r in await asyncio.gather(*sent)]


async def until_listed(client: httpx.AsyncClient, what: str, holds: object, traffic: np.ndarray | None) -> list[int]:
    """Send bursts of ``traffic`` (if any) until ``holds(listing)``; the statuses of every request sent."""
    statuses: list[int] = []
    deadline = time.monotonic() + DEADLINE_S
    while not holds(await listing(client)):  # type: ignore[operator]
        assert time.monotonic() < deadline, f"not within {DEADLINE_S:g} s: {what}"
        if traffic is not None:
            statuses += await burst(client, traffic)
        else:
            await asyncio.sleep(0.01)
    return statuses


async def test_drifted_traffic_demotes_the_model_to_fp32_within_its_window_failing_no_request(
    drift_store: tuple[Path, np.ndarray],
) -> None:
    store, calibration = drift_store
    async with serving(live_settings(store)) as client:
        listed = await listing(client)
        assert listed["precision"] == "bf16"  # it met its bar at load
        f = listed["fidelity"]
        assert isinstance(f, dict)
        assert (f["source"], f["top1_agreement"]) == ("calibration", 1.0)
        assert (await live(client))["rows_compared"] == 0

        # Traffic like the calibration samples: compared, and in agreement.
        assert await burst(client, calibration[: WINDOW // 2], WINDOW // 2) == [200] * (WINDOW // 2)
        await until_listed(client, "the first rows compared", lambda m: m["live_fidelity"]["rows_compared"] >= 10, None)
        figures = (await live(client))["figures"]
        assert isinstance(figures, dict)
        assert figures["top1_agreement"] == 1.0
        assert (await listing(client))["precision"] == "bf16"

        # Drifted traffic, sent concurrently across the switch: every request is answered.
        drifted = calibration.copy()
        drifted[:, 0] = SHIFT
        statuses = await until_listed(client, "the demotion", lambda m: m["precision"] == "fp32", drifted)
        statuses += await burst(client, drifted, 32)
        assert statuses
        assert set(statuses) == {200}

        listed = await listing(client)
        assert listed["precision_source"] == "live_fidelity"
        reason = str(listed["fp32_fallback"])
        assert reason.startswith("live fidelity: bf16 top-1 agreement with fp32 is ")
        assert f"on {WINDOW} live samples" in reason  # demoted as soon as its window was full
        found = await live(client)
        assert found["shortfall"] == reason.removeprefix("live fidelity: ")
        r = await client.post("/predict", json={"inputs": [drifted[0].tolist()]})
        assert r.json()["precision"] == "fp32"

        assert await metric(client, 'halfserve_live_fidelity_shortfalls_total{action="demote",model="drift"}') == 1.0
        assert await metric(client, 'halfserve_model_fp32_fallback{model="drift",version="1"}') == 1.0
        compared = await metric(client, 'halfserve_live_fidelity_rows_total{model="drift"}')
        assert compared is not None
        assert compared >= WINDOW
        top1 = await metric(client, 'halfserve_live_fidelity_top1_agreement{model="drift"}')
        assert top1 is not None
        assert top1 < 0.98

        # The operator serves it in bf16 again: an empty window, no stale reason, and the same drift demotes it again.
        r = await client.post("/models/drift/precision", json={"precision": "bf16"}, headers=AUTH)
        assert r.status_code == 200, r.text
        listed = await listing(client)
        assert (listed["precision"], listed["precision_source"], listed["fp32_fallback"]) == ("bf16", "operator", None)
        again = await live(client)
        assert (again["window_rows"], again["shortfall"]) == (0, None)
        statuses = await until_listed(client, "the second demotion", lambda m: m["precision"] == "fp32", drifted)
        assert set(statuses) == {200}
        assert (await listing(client))["precision_source"] == "live_fidelity"
        assert await metric(client, 'halfserve_live_fidelity_shortfalls_total{action="demote",model="drift"}') == 2.0


async def test_alert_only_keeps_the_precision_and_counts_the_shortfall(drift_store: tuple[Path, np.ndarray]) -> None:
    store, calibration = drift_store
    drifted = calibration.copy()
    drifted[:, 0] = SHIFT
    async with serving(live_settings(store, live_fidelity_action=LiveFidelityAction.ALERT)) as client:
        statuses = await until_listed(
            client, "the alert", lambda m: m["live_fidelity"]["shortfall"] is not None, drifted
        )
        assert set(statuses) == {200}
        listed = await listing(client)
        assert listed["precision"] == "bf16"
        assert listed["fp32_fallback"] is None
        assert listed["precision_source"] == "server"
        assert await metric(client, 'halfserve_live_fidelity_shortfalls_total{action="alert",model="drift"}') == 1.0
        assert await metric(client, 'halfserve_model_fp32_fallback{model="drift",version="1"}') == 0.0


async def test_rate_zero_samples_nothing(drift_store: tuple[Path, np.ndarray]) -> None:
    store, calibration = drift_store
    drifted = calibration.copy()
    drifted[:, 0] = SHIFT
    async with serving(live_settings(store, live_fidelity_rate=0.0)) as client:
        assert await burst(client, drifted, 32) == [200] * 32
        listed = await listing(client)
        assert listed["live_fidelity"] is None
        assert listed["precision"] == "bf16"
        assert "halfserve_live_fidelity_rows_total{" not in (await client.get("/metrics")).text


BODY = {"in_features": FEATURES, "hidden": [FEATURES], "out_features": CLASSES}


def drifting_head(root: Path) -> tuple[Path, np.ndarray]:
    """The drifting classifier above behind an exact body (an identity layer and a ReLU): on drifted rows whose
    values bf16 holds exactly, the body is exact in bf16 and only the head flips classes, so keeping the head alone
    in fp32 answers as fp32 does. Returns the store and its calibration samples."""
    torch.manual_seed(0)
    module = models.build("mlp", **BODY)
    w = torch.randn(CLASSES, FEATURES)
    w[:, 0] = 1000.0
    with torch.no_grad():
        module.net[0].weight.copy_(torch.eye(FEATURES))
        module.net[0].bias.zero_()
        module.net[2].weight.copy_(w)
        module.net[2].bias.zero_()
    torch.save(module.state_dict(), root / "head.pth")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(1024, FEATURES)).astype(np.float32)
    x[:, 0] = 0.0
    scores = np.sort(np.maximum(x, 0) @ w.numpy().T, axis=1)
    clear = x[(scores[:, -1] - scores[:, -2]) > 0.1 * np.abs(scores[:, -1])][:64]
    np.save(root / "calib.npy", clear)
    args = ["import", str(root / "head.pth"), "--store", str(root / "store"), "--name", "drift"]
    args += ["--architecture", "mlp", "--arch-kwargs", json.dumps(BODY), "--input", f"x:{FEATURES}"]
    assert cli.main([*args, "--device", "cpu", "--calibration", str(root / "calib.npy")]) == 0
    return root / "store", clear


async def test_drift_on_one_layer_demotes_to_a_plan_searched_on_the_live_rows(tmp_path: Path) -> None:
    store, calibration = drifting_head(tmp_path)
    drifted = torch.from_numpy(calibration.copy())
    drifted[:, 0] = SHIFT
    exact = drifted.bfloat16().float().numpy()  # values bf16 holds: the identity body is exact in bf16
    async with serving(live_settings(store)) as client:
        assert (await listing(client))["precision_source"] == "server"  # bf16 met its bar at load
        statuses = await until_listed(
            client, "the demotion", lambda m: m["precision_source"] == "live_mixed_plan", exact
        )
        statuses += await burst(client, exact, 32)
        assert set(statuses) == {200}

        listed = await listing(client)
        assert listed["precision"] == "bf16"  # still half, but for the head
        assert listed["fp32_fallback"] is None
        found = listed["mixed_precision"]
        assert isinstance(found, dict)
        assert found["plan"]["fp32_modules"] == ["net.2"]
        assert found["plan"]["fidelity"]["source"] == "live"
        assert found["plan"]["fidelity"]["top1_agreement"] == 1.0
        assert str(found["reason"]).startswith("searched on ")
        assert "rows of live traffic" in str(found["reason"])
        assert await metric(client, 'halfserve_live_fidelity_shortfalls_total{action="demote",model="drift"}') == 1.0
        assert await metric(client, 'halfserve_model_fp32_fallback{model="drift",version="1"}') == 0.0

        reference = models.build("mlp", **BODY)
        reference.load_state_dict(torch.load(tmp_path / "head.pth", weights_only=True))
        with torch.no_grad():
            want = reference(torch.from_numpy(exact)).argmax(1).numpy()
        r = await client.post("/predict", json={"inputs": exact.tolist()})
        assert r.status_code == 200, r.text
        assert (np.asarray(r.json()["outputs"]).argmax(1) == want).all()

        # The plan is watched as the whole model was: a full window of the same traffic agrees, and it stays.
        await until_listed(client, "a full window", lambda m: m["live_fidelity"]["window_rows"] >= WINDOW, exact)
        again = await live(client)
        assert again["shortfall"] is None
        assert again["figures"]["top1_agreement"] == 1.0  # type: ignore[index]
        assert (await listing(client))["precision_source"] == "live_mixed_plan"


OFFSET = 1000.0
"""Where the offset model's real inputs sit: bf16 holds values near 1000 to steps of 4, so their small parts vanish."""


def offset_model(root: Path, capsys: pytest.CaptureFixture[str]) -> Path:
    """A model of inputs near :data:`OFFSET` (``relu(x - 1000)`` then a linear head, no bias), imported without
    calibration samples: on the random N(0, 1) samples every row is 0 both ways, so it meets its bar, while on its
    real inputs bf16 rounds ``x`` to 1000 or 1004 and answers zeros where fp32 answers ``relu(x - 1000)``'s scores."""
    torch.manual_seed(0)
    module = models.build("mlp", **BODY)
    with torch.no_grad():
        module.net[0].weight.copy_(torch.eye(FEATURES))
        module.net[0].bias.fill_(-OFFSET)
        module.net[2].bias.zero_()
    torch.save(module.state_dict(), root / "offset.pth")
    args = ["import", str(root / "offset.pth"), "--store", str(root / "store"), "--name", "drift"]
    args += ["--architecture", "mlp", "--arch-kwargs", json.dumps(BODY), "--input", f"x:{FEATURES}"]
    assert cli.main([*args, "--device", "cpu"]) == 0
    printed = capsys.readouterr().out
    assert "met on 64 random samples, not your data (give --calibration FILE to measure on real inputs)" in printed
    return root / "store"


async def test_a_default_met_on_random_samples_only_is_demoted_on_probation_at_the_default_rate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """At rate 0.001 its first decision took about WINDOW / 0.001 rows answered wrong; a new engine's first rows are
    all sampled, so the rows of one burst decide."""
    store = offset_model(tmp_path, capsys)
    real = (OFFSET + np.random.default_rng(0).normal(size=(2 * WINDOW, FEATURES))).astype(np.float32)
    async with serving(live_settings(store, live_fidelity_rate=0.001)) as client:
        listed = await listing(client)
        assert (listed["precision"], listed["precision_source"]) == ("bf16", "server")
        record = listed["precision_record"]
        assert isinstance(record, dict)
        assert record["check"] == "trusted"
        assert str(record["caveat"]).startswith("measured on 64 random samples, not your data: import it again with ")
        found = await live(client)
        assert (found["rate"], found["probation_rows_left"]) == (0.001, WINDOW)

        assert await burst(client, real, 2 * WINDOW) == [200] * (2 * WINDOW)  # every row answered, no more sent
        await until_listed(client, "the demotion", lambda m: m["precision"] == "fp32", None)
        listed = await listing(client)
        assert listed["precision_source"] == "live_fidelity"
        assert f"on {WINDOW} live samples" in str(listed["fp32_fallback"])
        found = await live(client)
        assert found["probation_rows_left"] == 0
        r = await client.post("/predict", json={"inputs": [real[0].tolist()]})
        assert (r.status_code, r.json()["precision"]) == (200, "fp32")
