"""One placement decision (halfserve.placement.choose), from the server's setting, the model's manifest and device,
and, only where it needs one, the in-process engine's timing: tested with made-up engines and no torch."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from halfserve.execution import Execution, Isolation
from halfserve.placement import (
    LOOP_SECONDS_PER_ROW,
    LOOP_STALL_FACTOR,
    LOOP_STALL_FLOOR_SECONDS,
    Placement,
    PlacementSetting,
    choose,
    leaves_loop,
    loop_stall_bound,
)
from halfserve.settings import Settings


@dataclass
class Device:
    type: str


@dataclass
class Timed:
    """A made-up engine after warm-up: one CPU instance whose full batch of 32 rows is loop bound on one thread."""

    device: Device
    threads: int | None = 1
    loop_bound: bool | None = True
    batch_seconds: float | None = 0.5 * 32 * LOOP_SECONDS_PER_ROW
    batch_rows: int = 32
    cores: int = 2
    instance_count: int = 1
    traceable: bool = True


class Measure:
    """The engine a choice builds and times, counting how often it is asked for."""

    def __init__(self, engine: Timed) -> None:
        self.engine, self.calls = engine, 0

    def __call__(self) -> Timed:
        self.calls += 1
        return self.engine


CPU, CUDA = Device("cpu"), Device("cuda")


def test_the_setting_takes_every_placement_and_auto() -> None:
    assert [s.value for s in PlacementSetting] == ["auto", *(p.value for p in Placement)]
    assert PlacementSetting.AUTO.placement is None
    assert all(PlacementSetting(p.value).placement is p for p in Placement)


@pytest.mark.parametrize(
    ("setting", "isolation", "device"),
    [
        (PlacementSetting.AUTO, None, CUDA),  # processes by default on CUDA
        (PlacementSetting.AUTO, Isolation.PROCESS, CPU),  # the manifest's, where the server leaves it to auto
        (PlacementSetting.INSTANCE_PROCESSES, Isolation.THREAD, CPU),  # the server's outranks the manifest's
    ],
)
def test_instance_processes_are_chosen_without_building_an_engine_here(
    setting: PlacementSetting, isolation: Isolation | None, device: Device
) -> None:
    measure = Measure(Timed(device))
    assert choose(setting, Execution(isolation=isolation), device, measure) is Placement.INSTANCE_PROCESSES
    assert measure.calls == 0


def test_a_manifest_asking_for_threads_on_cuda_is_served_in_this_process() -> None:
    measure = Measure(Timed(CUDA))
    assert choose(PlacementSetting.AUTO, Execution(isolation=Isolation.THREAD), CUDA, measure) is (
        Placement.INSTANCE_THREADS  # never on the loop on a GPU
    )
    assert measure.calls == 1


def test_auto_on_a_cpu_decides_from_the_timing_once() -> None:
    engine = Timed(CPU)
    measure = Measure(engine)
    assert choose(PlacementSetting.AUTO, Execution(), CPU, measure) is Placement.BESIDE_LOOP
    assert measure.calls == 1
    engine.traceable = False
    assert choose(PlacementSetting.AUTO, Execution(), CPU, Measure(engine)) is Placement.EVENT_LOOP
    engine.loop_bound = False  # a forward longer than the loop's work keeps its thread
    assert choose(PlacementSetting.AUTO, Execution(), CPU, Measure(engine)) is Placement.INSTANCE_THREADS


@pytest.mark.parametrize("placement", [Placement.INSTANCE_THREADS, Placement.EVENT_LOOP, Placement.BESIDE_LOOP])
def test_a_placement_asked_for_is_taken_where_the_engine_can(placement: Placement) -> None:
    engine = Timed(CPU, loop_bound=False, batch_seconds=1.0)  # auto would keep it on its thread
    assert choose(PlacementSetting(placement.value), Execution(), CPU, Measure(engine)) is placement


def test_a_placement_the_engine_cannot_take_is_decided_as_auto_would() -> None:
    two = Timed(CPU, instance_count=2)
    assert choose(PlacementSetting.EVENT_LOOP, Execution(), CPU, Measure(two)) is Placement.INSTANCE_THREADS
    untraceable = Timed(CPU, traceable=False)
    assert choose(PlacementSetting.BESIDE_LOOP, Execution(), CPU, Measure(untraceable)) is Placement.EVENT_LOOP


@pytest.mark.parametrize(
    ("alias", "placement"),
    [
        ({"forward_on_event_loop": True}, PlacementSetting.EVENT_LOOP),
        ({"forward_on_event_loop": False}, PlacementSetting.INSTANCE_THREADS),
        ({"pipeline_forward": True}, PlacementSetting.BESIDE_LOOP),
        ({"instance_isolation": "process"}, PlacementSetting.INSTANCE_PROCESSES),
        ({"instance_isolation": "thread"}, PlacementSetting.INSTANCE_THREADS),
        ({"instance_isolation": "process", "placement": "instance_processes"}, PlacementSetting.INSTANCE_PROCESSES),
    ],
)
def test_the_deprecated_flags_are_aliases_of_placement(alias: dict[str, object], placement: PlacementSetting) -> None:
    assert Settings(**alias).placement is placement  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "alias",
    [
        {"forward_on_event_loop": True, "instance_isolation": "process"},
        {"placement": "beside_loop", "forward_on_event_loop": True},
        {"pipeline_forward": False},
    ],
)
def test_placement_flags_that_disagree_are_refused(alias: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="placement"):
        Settings(**alias)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("batch_seconds", "bound"),
    [
        (None, LOOP_STALL_FLOOR_SECONDS),  # not timed at warm-up
        (0.25e-3, LOOP_STALL_FLOOR_SECONDS),  # a loop-bound forward: ten times it is still under the floor
        (0.02, LOOP_STALL_FACTOR * 0.02),  # a forward placed on the loop by the operator, longer than the floor's tenth
    ],
)
def test_a_forward_on_the_event_loop_leaves_it_past_ten_times_its_warm_up_and_at_least_the_floor(
    batch_seconds: float | None, bound: float
) -> None:
    assert loop_stall_bound(batch_seconds) == pytest.approx(bound)
    assert not leaves_loop(bound, loop_stall_bound(batch_seconds))
    assert not leaves_loop(bound / 2, loop_stall_bound(batch_seconds))
    assert leaves_loop(bound * 1.01, loop_stall_bound(batch_seconds))
    assert leaves_loop(6.1, loop_stall_bound(batch_seconds))  # a request that made an iterating model loop 6 s
