"""A model on the event loop's thread whose forward requests make slow: one slow forward leaves it there (it may be
a pause of the host), a second moves its batches off the loop for good, and the loop answers while the next slow one
runs."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from halfserve import models, store
from halfserve.manifest import Manifest, TensorSpec
from halfserve.settings import Settings
from tests.integration.conftest import serving

SLEEPS = 1000.0
"""A first feature that makes the forward sleep :data:`SLEEP_S`: far past a forward's bound on the event loop of
10 ms, and, less the longest of two, past their budget of 100 ms."""
SLEEP_S = 0.3
HELD = 2000.0
"""A first feature that makes the forward wait for the test's release (or its deadline)."""
HOLD_DEADLINE_S = 30.0


class Gate:
    """What the held forward tells the test, and how the test lets it go."""

    entered = threading.Event()
    release = threading.Event()
    deadline_passed: list[bool] = []


@models.register("test_slow_for_a_marked_input")
class SlowForAMarkedInput(nn.Module):
    """A linear model that is fast, except for a row whose first feature marks it slow (as a model that refines
    its answer for as many steps as the input asks)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first = x[:, 0].float()
        if bool((first == SLEEPS).any()):
            time.sleep(SLEEP_S)
        if bool((first == HELD).any()):
            Gate.entered.set()
            Gate.deadline_passed.append(not Gate.release.wait(HOLD_DEADLINE_S))
        return self.linear(x)


def save_slow(root: Path) -> Path:
    manifest = Manifest(
        name="slow",
        architecture="test_slow_for_a_marked_input",
        inputs=[TensorSpec(name="x", shape=[4])],
        outputs=[TensorSpec(name="y", shape=[2])],
    )
    return store.save(root, manifest, models.build("test_slow_for_a_marked_input"))


@pytest.mark.instance_threads
async def test_slow_forwards_that_stall_the_event_loop_move_their_models_batches_to_an_instance_thread(
    tmp_path: Path,
) -> None:
    save_slow(tmp_path)
    Gate.entered.clear()
    Gate.release.clear()
    Gate.deadline_passed.clear()
    # On the loop by the operator's choice, its warm-up forward made up at 0.1 ms: its bound is the 10 ms floor.
    settings = Settings(store=tmp_path, precision="fp32", placement="event_loop", forward_seconds=1e-4)  # type: ignore[arg-type]
    async with serving(settings) as client:

        async def execution() -> dict[str, object]:
            (entry,) = (await client.get("/models")).json()["models"]
            return dict(entry["execution"])

        assert (await execution())["placement"] == "event_loop"
        fast = await client.post("/predict", json={"inputs": [[0.5, 0, 0, 0]]})
        assert fast.status_code == 200, fast.text
        assert (await execution())["placement"] == "event_loop"

        first = await client.post("/predict", json={"inputs": [[SLEEPS, 0, 0, 0]]})
        assert first.status_code == 200, first.text
        kept = await execution()
        assert kept["placement"] == "event_loop"  # one slow forward alone may be a pause of the host
        assert kept["placement_changed"] is None

        second = await client.post("/predict", json={"inputs": [[SLEEPS, 0, 0, 0]]})
        assert second.status_code == 200, second.text  # the slow request itself is answered, on the loop
        moved = await execution()
        assert moved["placement"] == "instance_threads"
        assert "forwards on the event loop's thread ran past their bound of 10 ms" in str(moved["placement_changed"])

        third = asyncio.create_task(client.post("/predict", json={"inputs": [[HELD, 0, 0, 0]]}))
        try:
            assert await asyncio.to_thread(Gate.entered.wait, HOLD_DEADLINE_S)
            health = await client.get("/health")  # the loop answers while the held forward runs
            assert health.status_code == 200
        finally:
            Gate.release.set()
        answered = await third
        assert answered.status_code == 200, answered.text
        assert Gate.deadline_passed == [False]  # released by the test, not by its deadline
        assert (await execution())["placement"] == "instance_threads"
