"""The collector's settings for a serving process (halfserve.collector)."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from halfserve import collector


@pytest.fixture
def restored_gc() -> Iterator[None]:
    threshold = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*threshold)


def young_collections_holding(objects: int) -> int:
    """Young-generation collections while ``objects`` dicts are created and kept alive, as requests in flight keep
    theirs."""
    seen: list[int] = []

    def count(phase: str, info: dict[str, int]) -> None:
        if phase == "start" and info["generation"] == 0:
            seen.append(1)

    gc.collect()
    gc.callbacks.append(count)
    try:
        held = [{"request": i} for i in range(objects)]
    finally:
        gc.callbacks.remove(count)
    del held
    return len(seen)


@pytest.mark.usefixtures("restored_gc")
def test_settle_freezes_the_heap_and_raises_the_young_threshold() -> None:
    gc.set_threshold(700, 10, 10)
    before = gc.get_freeze_count()
    alive = [{"long": "lived"}]
    collector.settle()
    assert gc.get_freeze_count() > before
    assert gc.get_threshold() == (collector.YOUNG_THRESHOLD, 10, 10)  # the older generations' as they were
    assert alive


@pytest.mark.usefixtures("restored_gc")
def test_settle_keeps_a_higher_threshold() -> None:
    gc.set_threshold(collector.YOUNG_THRESHOLD * 2, 5, 7)
    collector.settle()
    assert gc.get_threshold() == (collector.YOUNG_THRESHOLD * 2, 5, 7)


@pytest.mark.usefixtures("restored_gc")
def test_objects_held_in_flight_start_no_young_collection_once_settled() -> None:
    in_flight = 64 * 150  # far more containers than 64 requests in flight hold
    gc.set_threshold(700, 10, 10)
    assert young_collections_holding(in_flight) >= in_flight // 700 - 1
    collector.settle()
    assert young_collections_holding(in_flight) == 0
