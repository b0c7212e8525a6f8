"""Live fidelity's pieces without a server: the sampler (a made-up random source), the CPU share cap (made-up
times), the window and its figures, the queue bound, the tap, and the rerun against the host fp32 weights."""

from __future__ import annotations

import asyncio
import random
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from halfserve import fidelity, store
from halfserve.livefidelity import (
    QUEUE_ENTRIES,
    LiveFidelity,
    LiveSettings,
    Sampled,
    Sampler,
    Window,
    pause,
    samples_live,
)
from halfserve.manifest import Precision, TensorSpec
from halfserve.serving import Outcome, Output
from halfserve.settings import LiveFidelityAction, Settings
from tests.conftest import save_tiny_mlp
from tests.waiting import DEADLINE_S, wait_until


def picked_over(sampler: Sampler, batches: list[int]) -> list[int]:
    """The sampled rows' indices over consecutive batches of these sizes, counted from the first batch's first row."""
    found, start = [], 0
    for rows in batches:
        found += [start + i for i in sampler.take(rows)]
        start += rows
    return found


def test_every_row_is_sampled_at_rate_one_and_none_at_rate_zero() -> None:
    assert picked_over(Sampler(1.0), [3, 1, 5]) == list(range(9))
    assert picked_over(Sampler(0.0), [1000] * 100) == []


def test_the_gaps_follow_the_random_source_across_batch_boundaries() -> None:
    # u = 0.5 at rate 0.5: a gap of floor(log 0.5 / log 0.5) = 1 row before each sampled row.
    sampler = Sampler(0.5, uniform=lambda: 0.5)
    assert picked_over(sampler, [3, 2, 1, 4]) == [1, 3, 5, 7, 9]


def test_the_share_sampled_is_the_rate() -> None:
    sampler = Sampler(0.001, uniform=random.Random(0).random)
    picked = picked_over(sampler, [64] * 20_000)  # 1,280,000 rows
    assert 1100 < len(picked) < 1460  # 1,280 expected; the binomial's sd is about 36
    assert len(set(picked)) == len(picked)


def test_a_rate_outside_zero_to_one_is_refused() -> None:
    with pytest.raises(ValueError, match="rate"):
        Sampler(1.5)


@pytest.mark.parametrize("share", [0.1, 0.25, 1.0])
def test_the_pause_holds_the_reruns_to_their_cpu_share(share: float) -> None:
    for took in (0.001, 0.02, 3.0):
        waited = pause(took, share)
        assert took / (took + waited) == pytest.approx(share)


def agreeing(n: int, agree: bool) -> fidelity.Rows:
    return fidelity.Rows(np.full(n, agree), None, np.full(n, 0.5 if agree else 2.0), None, None)


def test_the_window_keeps_the_last_rows_and_gives_their_figures() -> None:
    window = Window(4)
    assert window.figures(Precision.BF16) is None
    window.add(agreeing(3, True))
    window.add(agreeing(2, False))  # pushes the first two out
    assert len(window) == 4
    f = window.figures(Precision.BF16)
    assert f is not None
    assert (f.samples, f.top1_agreement, f.max_abs_error, f.source, f.precision) == (4, 0.5, 2.0, "live", "bf16")
    window.clear()
    assert len(window) == 0


def test_the_window_figures_are_those_of_the_check_at_load(tmp_path: Path) -> None:
    """Rows compared one by one into the window give what :func:`fidelity.compare` gives for them together."""
    save_tiny_mlp(tmp_path, outputs=[TensorSpec(name="logits", shape=[4]), TensorSpec(name="score", shape=[1])])
    manifest = store.load(tmp_path, "tiny").manifest
    rng = np.random.default_rng(0)
    dtype = np.dtype([("logits", np.float32, (4,)), ("score", np.float32, ())])
    want, got = np.zeros(6, dtype), np.zeros(6, dtype)
    want["logits"], want["score"] = rng.normal(size=(6, 4)), rng.normal(size=6)
    got["logits"], got["score"] = want["logits"] + rng.normal(scale=0.5, size=(6, 4)), want["score"] + 0.01
    window = Window(10)
    for i in range(6):
        window.add(fidelity.rows(want[i : i + 1], got[i : i + 1], manifest))
    together = fidelity.compare(want, got, manifest, Precision.BF16, fidelity.Source.LIVE)
    assert window.figures(Precision.BF16) == together
    assert together.max_rel_error == pytest.approx(0.01 / np.abs(want["score"]).max(), rel=1e-4)


def never(chunks: list[np.ndarray]) -> asyncio.Future[list[Outcome]]:
    raise AssertionError("not run")


def live_settings(**given: object) -> LiveSettings:
    fields: dict[str, object] = {
        "rate": 1.0,
        "cpu_share": 1.0,
        "window": 10,
        "min_rows": 4,
        "action": LiveFidelityAction.DEMOTE,
    }
    fields.update(given)
    return LiveSettings(**fields)  # type: ignore[arg-type]


@pytest.fixture
def loaded(tmp_path: Path) -> store.LoadedModel:
    save_tiny_mlp(tmp_path)
    return store.load(tmp_path, "tiny")


def test_a_full_queue_drops_the_sampled_rows_and_counts_them(loaded: store.LoadedModel) -> None:
    live = LiveFidelity("tiny", loaded, fidelity.DEFAULT_BAR, live_settings(), lambda _: None)
    live.tap(never, Precision.BF16)  # the precision its rows are in
    x = np.zeros((2, 16), np.float32)
    out = Output(np.zeros((2, 4), np.float32), Precision.BF16)
    for _ in range(QUEUE_ENTRIES + 3):  # no worker started: nothing takes them out
        live.offer([x], [out], Precision.BF16, live.taps)
    assert live.rows_dropped == 3 * 2
    # Rows rerun in fp32 after an overflow, and failed chunks, are not sampled at all.
    live.offer([x, x], [Output(out.data, Precision.FP32), RuntimeError("failed")], Precision.BF16, live.taps)
    assert live.rows_dropped == 3 * 2
    live.close()


def test_the_tap_answers_the_batch_unchanged_and_copies_only_sampled_rows(loaded: store.LoadedModel) -> None:
    settings = live_settings(rate=0.5, probation=0)  # the rate alone
    live = LiveFidelity("tiny", loaded, fidelity.DEFAULT_BAR, settings, lambda _: None, lambda: 0.5)
    outcomes = [np.arange(8, dtype=np.float32).reshape(2, 4), np.ones((3, 4), np.float32)]

    async def answered() -> object:
        answer: asyncio.Future[list[Outcome]] = asyncio.get_running_loop().create_future()
        tapped = live.tap(lambda chunks: answer, Precision.BF16)
        assert tapped(chunks) is answer  # the engine's own future: the batch costs no task or coroutine more
        answer.set_result(outcomes)
        return await answer

    chunks = [np.zeros((2, 16), np.float32), np.arange(48, dtype=np.float32).reshape(3, 16)]
    assert asyncio.run(answered()) is outcomes
    sampled = live._queue.get_nowait()
    assert sampled is not None
    # Rows 1 and 3 of the batch: the first chunk's second row and the second chunk's second row.
    np.testing.assert_array_equal(sampled.inputs, np.stack([chunks[0][1], chunks[1][1]]))
    np.testing.assert_array_equal(sampled.outputs, np.stack([outcomes[0][1], outcomes[1][1]]))
    sampled.inputs[:] = -1  # a copy: the request's rows are not touched
    assert (chunks[0] == 0).all()
    assert (chunks[1] >= 0).all()
    live.close()


def test_rows_rerun_in_fp32_fill_the_window_and_a_shortfall_is_told_once(loaded: store.LoadedModel) -> None:
    told: list[str] = []
    live = LiveFidelity("tiny", loaded, fidelity.DEFAULT_BAR, live_settings(), told.append)
    live.tap(never, Precision.BF16)
    x = np.random.default_rng(0).normal(size=(3, 16)).astype(np.float32)
    with torch.inference_mode():
        right = loaded.module(torch.from_numpy(x)).numpy()
    live.compare(Sampled(x, right.astype(np.float32), Precision.BF16, 1))  # what fp32 gives: full agreement
    assert (live.rows_compared, told) == (3, [])
    wrong = np.roll(right, 1, axis=1)  # every row's top class moved
    live.compare(Sampled(x, wrong, Precision.BF16, 1))  # 6 rows now: past min_rows, top-1 agreement 0.5
    assert len(told) == 1
    assert "top-1 agreement with fp32 is 0.5000 on 6 live samples" in told[0]
    live.compare(Sampled(x, wrong, Precision.BF16, 1))
    assert len(told) == 1  # told once
    described = live.describe()
    assert described["rows_compared"] == 9
    assert described["window_rows"] == 9
    assert described["shortfall"] == told[0]
    figures = described["figures"]
    assert isinstance(figures, dict)
    assert figures["top1_agreement"] == pytest.approx(3 / 9)
    live.tap(never, Precision.BF16)  # another engine starts afresh, and rows sampled from the one before are let go
    assert live.describe()["window_rows"] == 0
    assert live.describe()["shortfall"] is None
    live.compare(Sampled(x, wrong, Precision.BF16, 1))
    assert live.describe()["window_rows"] == 0
    live.close()


def test_only_half_precision_rows_of_fixed_shape_are_sampled_at_a_rate_above_zero(loaded: store.LoadedModel) -> None:
    on = live_settings(rate=0.001)
    assert samples_live(loaded.manifest, Precision.BF16, on)
    assert not samples_live(loaded.manifest, Precision.FP32, on)  # nothing to compare
    assert not samples_live(loaded.manifest, Precision.BF16, live_settings(rate=0.0))
    variable = loaded.manifest.model_copy(update={"outputs": [TensorSpec(name="tokens", shape=[-1, 4])]})
    assert not samples_live(variable, Precision.BF16, on)
    assert LiveSettings.of(Settings()) == LiveSettings(0.001, 0.1, 1000, 100, LiveFidelityAction.DEMOTE)


def test_a_min_rows_above_the_window_is_refused() -> None:
    with pytest.raises(ValueError, match="live_fidelity_min_rows"):
        Settings(live_fidelity_window=10, live_fidelity_min_rows=11)


def test_closing_ends_the_worker_s_pause_at_once(loaded: store.LoadedModel) -> None:
    """At a tiny CPU share the worker would pause for ages after a rerun; closing (a reload, shutdown) ends it."""
    live = LiveFidelity("tiny", loaded, fidelity.DEFAULT_BAR, live_settings(cpu_share=1e-9), lambda _: None)
    live.tap(never, Precision.BF16)
    live.start()
    x = np.zeros((1, 16), np.float32)
    live.offer([x], [np.zeros((1, 4), np.float32)], Precision.BF16, live.taps)
    wait_until(lambda: live.rows_compared == 1, "the row rerun")
    closing = threading.Thread(target=live.close)
    closing.start()
    closing.join(DEADLINE_S)
    assert not closing.is_alive()


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("live_fidelity_rate", 1.5),
        ("live_fidelity_rate", -0.1),
        ("live_fidelity_cpu_share", 0.0),
        ("live_fidelity_window", 10_000_000),  # the window is held in memory, row by row
        ("live_fidelity_action", "ignore"),
    ],
)
def test_settings_out_of_bounds_are_refused_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        Settings(**{field: value})  # type: ignore[arg-type]


def test_the_settings_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HALFSERVE_LIVE_FIDELITY_RATE", "0")
    monkeypatch.setenv("HALFSERVE_LIVE_FIDELITY_ACTION", "alert")
    settings = LiveSettings.of(Settings())
    assert (settings.rate, settings.action) == (0.0, LiveFidelityAction.ALERT)


RARELY = 0.5
"""A made-up draw at rate 0.001: a gap of floor(log 0.5 / log 0.999) = 692 rows before each sampled row."""


def rerun_queued(live: LiveFidelity) -> None:
    """What the worker thread does with each queued batch, here and now."""
    while not live._queue.empty():
        sampled = live._queue.get_nowait()
        assert sampled is not None
        live.rerun(sampled)


def test_a_new_engine_s_first_rows_are_all_sampled_until_its_first_decision(loaded: store.LoadedModel) -> None:
    """At rate 0.001 a model wrong on every real row was decided on after about min_rows / rate rows answered; on
    probation, after min_rows."""
    told: list[str] = []
    settings = live_settings(rate=0.001, window=10, min_rows=4)
    live = LiveFidelity("tiny", loaded, fidelity.DEFAULT_BAR, settings, told.append, lambda: RARELY)
    live.tap(never, Precision.BF16)
    assert live.describe()["probation_rows_left"] == 4
    x = np.random.default_rng(0).normal(size=(3, 16)).astype(np.float32)
    with torch.inference_mode():
        wrong = np.roll(loaded.module(torch.from_numpy(x)).numpy(), 1, axis=1)  # every top class moved
    live.offer([x], [wrong], Precision.BF16, live.taps)  # rows 0-2: all sampled
    live.offer([x], [wrong], Precision.BF16, live.taps)  # row 3: the probation's last; rows 4-5 are not
    rerun_queued(live)
    assert live.rows_compared == 4
    assert len(told) == 1
    assert "top-1 agreement with fp32 is 0.0000 on 4 live samples" in told[0]
    assert live.describe()["probation_rows_left"] == 0
    for _ in range(100):  # rows 6 to 305: below the rate's first pick (row 692)
        live.offer([x], [wrong], Precision.BF16, live.taps)
    assert live._queue.empty()
    live.tap(never, Precision.BF16)  # another engine: another probation
    assert live.describe()["probation_rows_left"] == 4
    live.offer([x], [wrong], Precision.BF16, live.taps)
    rerun_queued(live)
    assert (live.rows_compared, live.describe()["probation_rows_left"]) == (7, 1)
    live.close()


def test_a_flood_on_probation_copies_only_the_rows_it_owes_and_a_failed_rerun_is_owed_again(
    loaded: store.LoadedModel,
) -> None:
    live = LiveFidelity(
        "tiny", loaded, fidelity.DEFAULT_BAR, live_settings(rate=0.001, min_rows=4), lambda _: None, lambda: RARELY
    )
    live.tap(never, Precision.BF16)
    x = np.zeros((3, 16), np.float32)
    out = np.zeros((3, 4), np.float32)
    for _ in range(200):  # no worker yet: the owed rows wait in the queue, and no more are copied meanwhile
        live.offer([x], [out], Precision.BF16, live.taps)
    assert live._queue.qsize() == 2  # rows 0-2 and row 3
    assert live.rows_dropped == 0
    broken = Sampled(np.zeros((3, 5), np.float32), out, Precision.BF16, live.taps)  # rows the reference cannot take
    live._queue.get_nowait()
    live.rerun(broken)  # failed: dropped, and owed again
    assert live.rows_dropped == 3
    live.offer([x], [out], Precision.BF16, live.taps)
    rerun_queued(live)
    assert (live.rows_compared, live.describe()["probation_rows_left"]) == (4, 0)
    live.close()
