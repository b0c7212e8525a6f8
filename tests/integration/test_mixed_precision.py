"""Mixed precision by measurement (issue 50): a model with one fragile layer, below its fidelity bar in half
precision, is served with only that layer in fp32 and meets the bar; with the search off it is served in fp32 as
before; a model whose only layer is the fragile one has no plan (keeping it all in fp32 is the fp32 model)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from halfserve import mixed, models
from halfserve import precision as prec
from halfserve.fidelity import DEFAULT_BAR, Fidelity
from halfserve.manifest import Precision
from halfserve.placement import PlacementSetting
from halfserve.settings import Settings
from tests.integration.conftest import serving
from tests.integration.test_fidelity_bar import entry, fallback_gauge, import_

FEATURES, CLASSES = 16, 10
DEEP = {"in_features": FEATURES, "hidden": [64, 64], "out_features": CLASSES}


def fragile_head(path: Path) -> Path:
    """A healthy two-layer body under a final projection whose class weights are one vector plus 1e-3 noise: its
    scores differ by far less than bf16 resolves, so bf16 picks classes at random there, and only there."""
    torch.manual_seed(0)
    module = models.build("mlp", **DEEP)
    head = module.net[4]
    with torch.no_grad():
        head.weight.copy_(torch.randn(1, 64) + 1e-3 * torch.randn(CLASSES, 64))
        head.bias.zero_()
    torch.save(module.state_dict(), path)
    return path


@pytest.fixture(scope="module")
def deep_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("mixed")
    assert import_(fragile_head(root / "w.pth"), root / "store", "head", kwargs=DEEP) == 0
    return root / "store"


def test_import_finds_the_plan_and_says_the_server_will_serve_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert import_(fragile_head(tmp_path / "w.pth"), tmp_path / "store", "head", kwargs=DEEP) == 0
    out = capsys.readouterr().out
    assert "WARNING: below the fidelity bar" in out
    assert "mixed precision: bf16 with 1 of 3 modules in fp32 (net.4;" in out
    assert "serves that plan, else fp32" in out
    assert "will serve this model in fp32" not in out
    record = json.loads((tmp_path / "store" / "head" / "1" / "precision.json").read_text())
    assert record["fp32_modules"] == ["net.4"]  # stored with the version, for a load to measure again


async def test_a_stored_plan_that_no_longer_meets_the_bar_is_searched_again(tmp_path: Path) -> None:
    root = tmp_path / "store"
    assert import_(fragile_head(tmp_path / "w.pth"), root, "head", kwargs=DEEP) == 0
    path = root / "head" / "1" / "precision.json"
    record = json.loads(path.read_text())
    record["fp32_modules"] = ["net.0"]  # a healthy layer: keeping it in fp32 leaves the fragile head in bf16
    path.write_text(json.dumps(record))
    async with serving(settings(root)) as client:
        plan = (await entry(client, "head"))["mixed_precision"]["plan"]  # type: ignore[index]
        shown = await metadata_record(client, "head")
    assert plan["fp32_modules"] == ["net.4"]
    assert plan["measurements"] > 1
    assert shown["check"] == "trusted"
    assert shown["record"]["fp32_modules"] == ["net.4"]  # what is served, not the stored plan that missed the bar


async def test_a_plan_found_at_load_is_in_the_record_the_v2_metadata_shows(tmp_path: Path) -> None:
    root = tmp_path / "store"
    assert import_(fragile_head(tmp_path / "w.pth"), root, "head", kwargs=DEEP) == 0
    (root / "head" / "1" / "precision.json").unlink()  # nothing stored: the load measures, then searches
    async with serving(settings(root)) as client:
        listed = await entry(client, "head")
        shown = await metadata_record(client, "head")
    assert listed["precision_source"] == "mixed_plan"
    assert shown["check"] == "measured"
    record = shown["record"]
    assert record["fp32_modules"] == ["net.4"]
    assert record["precision"] == "bf16"
    assert record["fidelity"]["top1_agreement"] < DEFAULT_BAR.min_top1_agreement  # the whole half model's figures
    assert listed["precision_record"] == shown  # /models and the V2 metadata say the same


async def metadata_record(client: object, name: str) -> dict[str, Any]:
    """The precision record in ``name``'s V2 model metadata ``parameters`` (a JSON string there)."""
    r = await client.get(f"/v2/models/{name}")  # type: ignore[attr-defined]
    assert r.status_code == 200, r.text
    shown: dict[str, Any] = json.loads(r.json()["parameters"]["precision_record"])
    return shown


def fp32_classes(store: Path, x: np.ndarray) -> np.ndarray:
    """The classes the imported weights give ``x`` in fp32."""
    reference = models.build("mlp", **DEEP)
    reference.load_state_dict(torch.load(store.parent / "w.pth", weights_only=True))
    with torch.no_grad():
        classes: np.ndarray = reference(torch.from_numpy(x)).argmax(1).numpy()
    return classes


def settings(store: Path, **extra: object) -> Settings:
    return Settings(store=store, precision=Precision.BF16, placement=PlacementSetting.INSTANCE_THREADS, **extra)  # type: ignore[arg-type]


async def test_a_model_with_one_fragile_layer_is_served_mixed_with_only_that_layer_in_fp32(
    deep_store: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="halfserve.repository"):
        async with serving(settings(deep_store)) as client:
            listed = await entry(client, "head")
            assert listed["precision"] == "bf16"
            assert listed["precision_source"] == "mixed_plan"
            assert listed["fp32_fallback"] is None
            found = listed["mixed_precision"]
            plan = found["plan"]  # type: ignore[index]
            assert plan["fp32_modules"] == ["net.4"]
            assert plan["measurements"] == 1  # the plan import stored, measured again: no search
            assert "stored plan" in found["reason"]  # type: ignore[index]
            assert plan["candidates"] == 3
            assert 0 < plan["parameters_fp32"] < 0.2
            assert plan["fidelity"]["top1_agreement"] >= DEFAULT_BAR.min_top1_agreement
            whole = listed["fidelity"]
            assert whole["top1_agreement"] < DEFAULT_BAR.min_top1_agreement  # type: ignore[index]
            assert await fallback_gauge(client, "head") == 0.0
            x = np.random.default_rng(1).standard_normal((32, FEATURES)).astype(np.float32)
            r = await client.post("/predict", json={"model": "head", "inputs": x.tolist()})  # type: ignore[attr-defined]
            assert r.status_code == 200, r.text
            want = fp32_classes(deep_store, x)
            got = np.asarray(r.json()["outputs"]).argmax(1)
            assert (got == want).mean() >= 0.9  # bf16 alone agrees on about 1 in 5; a near-tie may still flip
    assert any("is served mixed, bf16 with 1 of 3 modules in fp32 (net.4)" in m for m in caplog.messages)


async def test_instance_processes_serve_the_plan_too(deep_store: Path) -> None:
    placed = Settings(store=deep_store, precision=Precision.BF16, placement=PlacementSetting.INSTANCE_PROCESSES)
    async with serving(placed) as client:
        listed = await entry(client, "head")
        assert listed["precision_source"] == "mixed_plan"
        assert listed["mixed_precision"]["plan"]["fp32_modules"] == ["net.4"]  # type: ignore[index]
        x = np.random.default_rng(2).standard_normal((32, FEATURES)).astype(np.float32)
        r = await client.post("/predict", json={"model": "head", "inputs": x.tolist()})  # type: ignore[attr-defined]
        assert r.status_code == 200, r.text
        want = fp32_classes(deep_store, x)
        assert (np.asarray(r.json()["outputs"]).argmax(1) == want).mean() >= 0.9  # bf16 alone: about 1 in 5


async def test_with_the_search_off_the_model_is_served_in_fp32_as_before(deep_store: Path) -> None:
    async with serving(settings(deep_store, mixed_search_seconds=0)) as client:
        listed = await entry(client, "head")
        assert listed["precision"] == "fp32"
        assert listed["precision_source"] == "fidelity_fallback"
        assert listed["mixed_precision"] is None


class Fragile(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(FEATURES, 64)
        self.head = nn.Linear(64, CLASSES)
        with torch.no_grad():
            self.head.weight.copy_(torch.randn(1, 64) + 1e-3 * torch.randn(CLASSES, 64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.body(x)))


def test_a_plan_keeps_its_modules_weights_in_fp32_and_answers_as_fp32_does() -> None:
    model = Fragile()
    x = torch.randn(512, FEATURES)
    want = model(x).argmax(1)
    half = prec.prepare_model(Fragile(), Precision.BF16, torch.device("cpu"))
    prec.keep_fp32(half, ["head"], torch.bfloat16, model)
    assert half.head.weight.dtype == torch.float32
    assert half.body.weight.dtype == torch.bfloat16
    with torch.inference_mode():
        got = half(x)  # fp32 in: the body casts it to bf16, the head back up
    assert got.dtype == torch.float32
    assert bool((got.argmax(1) == want).all())
    plain = prec.prepare_model(Fragile(), Precision.BF16, torch.device("cpu"))
    ranked = mixed.rank(plain, lambda: plain(x[:64].bfloat16()), mixed.candidates(plain))
    assert [n for n, _ in ranked][0] == "head"
    assert ranked[0][1] > 10 * ranked[1][1]  # the fragile projection stands out from the healthy layer
    runs: list[int] = []
    one_by_one = mixed.rank(plain, lambda: runs.append(len(plain(x[:64].bfloat16()))), mixed.candidates(plain), 99)
    assert len(runs) == 2  # a run per twin: the ranking held one module's fp32 copy at a time
    assert dict(one_by_one) == dict(ranked)  # and scored the same


def test_the_ranking_s_twins_are_made_a_bounded_group_at_a_time() -> None:
    model = models.build("mlp", in_features=64, hidden=[256, 256, 256, 256], out_features=10)
    names = mixed.candidates(model)
    size = {n: sum(p.numel() for p in model.get_submodule(n).parameters()) for n in names}
    total = sum(size.values())
    groups = mixed.twin_groups(model, names, 4)
    assert [n for g in groups for n in g] == names  # every module, once, in order
    assert len(groups) > 1
    for g in groups:
        assert len(g) == 1 or sum(size[n] for n in g) <= total / 4
    assert mixed.twin_groups(model, names, 1) == [names]


def figures(top1: float) -> Fidelity:
    return Fidelity(64, "bf16", top1, 0.0, None)


def test_the_search_bisects_to_the_shortest_prefix_and_stops_at_its_time_limit() -> None:
    model = nn.Sequential(*(nn.Linear(4, 4) for _ in range(8)))
    ranked = [str(i) for i in range(8)]
    asked: list[int] = []

    def measure(plan: tuple[str, ...]) -> Fidelity:  # made-up: the bar is met once modules 0..2 are kept
        asked.append(len(plan))
        return figures(1.0 if len(plan) >= 3 else 0.5)

    found = mixed.search(ranked, measure, DEFAULT_BAR, model, Precision.BF16, 60.0, clock=lambda: 0.0)
    assert found.plan is not None
    assert found.plan.modules == ("0", "1", "2")
    assert asked[0] == 8
    assert len(asked) <= 5

    ticks = iter(range(100))
    slow = mixed.search(ranked, measure, DEFAULT_BAR, model, Precision.BF16, 1.5, clock=lambda: float(next(ticks)))
    assert slow.plan is not None
    assert len(slow.plan.modules) > 3

    nothing = mixed.search(ranked, lambda p: figures(0.5), DEFAULT_BAR, model, Precision.BF16, 60.0, lambda: 0.0)
    assert nothing.plan is None
    assert "still misses the bar" in str(nothing.reason)
    everything = mixed.search(
        ranked, lambda p: figures(1.0 if len(p) == 8 else 0.5), DEFAULT_BAR, model, Precision.BF16, 60.0, lambda: 0.0
    )
    assert everything.plan is None
    assert str(everything.reason) == (
        "only keeping all 8 modules with parameters in fp32 meets the bar: that is the fp32 model"
    )
    one = mixed.search(
        ["0"], lambda p: figures(1.0 if p else 0.5), DEFAULT_BAR, model, Precision.BF16, 60.0, lambda: 0.0
    )
    assert str(one.reason) == (  # had read "all 1 modules"
        "only keeping its one module with parameters in fp32 meets the bar: that is the fp32 model"
    )
    off = mixed.search(ranked, measure, DEFAULT_BAR, model, Precision.BF16, 0.0, clock=lambda: 0.0)
    assert off.plan is None
    assert "time limit" in str(off.reason)
