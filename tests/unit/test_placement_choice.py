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
    LoopStalls,
    Placement,
    PlacementSetting,
    StallRun,
    choose,
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


class Loop:
    """Forwards on a made-up event loop's clock, and what its :class:`LoopStalls` says of each."""

    def __init__(self, bound: float = LOOP_STALL_FLOOR_SECONDS) -> None:
        self.stalls = LoopStalls(bound)
        self.now = 1000.0

    def run(self, pattern: list[tuple[float, float]]) -> list[StallRun | None]:
        """Each forward of ``pattern``: the seconds the loop did other work before it, and the seconds it took."""
        runs = []
        for gap, seconds in pattern:
            self.now += gap + seconds
            runs.append(self.stalls.note(self.now, seconds))
        return runs


@pytest.mark.parametrize(
    ("batch_seconds", "bound"),
    [
        (None, LOOP_STALL_FLOOR_SECONDS),  # not timed at warm-up
        (0.25e-3, LOOP_STALL_FLOOR_SECONDS),  # a loop-bound forward: ten times it is still under the floor
        (0.02, LOOP_STALL_FACTOR * 0.02),  # a forward placed on the loop by the operator, longer than the floor's tenth
    ],
)
def test_a_forward_on_the_event_loop_runs_long_past_ten_times_its_warm_up_and_at_least_the_floor(
    batch_seconds: float | None, bound: float
) -> None:
    assert loop_stall_bound(batch_seconds) == pytest.approx(bound)
    loop = Loop(loop_stall_bound(batch_seconds))
    # Forwards at the bound do not run long: a thousand of them back to back never move the model.
    assert loop.run([(0.0, bound)] * 1000) == [None] * 1000
    # Just past it they do: back to back, they soon hold up the loop past the budget.
    runs = loop.run([(0.0, bound * 1.01)] * 20)
    assert runs[0] is None
    assert any(runs)


def test_forwards_just_under_any_one_forwards_bound_leave_the_loop_once_they_hold_it_up_past_the_budget() -> None:
    # Two clients sending an input that makes each forward sleep 45 ms: the loop answers a request or two between.
    loop = Loop()
    runs = loop.run([(0.001, 0.045)] * 4)
    assert runs[:3] == [None, None, None]  # 90 ms less the longest: within the budget of 100 ms
    assert runs[3] is not None
    assert runs[3].count == 4
    assert runs[3].seconds == pytest.approx(0.18)
    assert runs[3].longest == pytest.approx(0.045)
    assert runs[3].span == pytest.approx(0.183)


@pytest.mark.parametrize("gap", [0.0, 3.0, 5.0, 60.0, 300.0])
def test_two_forwards_of_seconds_leave_the_loop_at_the_second_even_a_while_apart(gap: float) -> None:
    loop = Loop()
    first, second = loop.run([(0.0, 6.0), (gap, 6.0)])
    assert first is None  # one forward alone, however long, may be a pause of the host
    assert second is not None
    assert second.count == 2
    assert second.span == pytest.approx(12.0 + gap)


def test_one_long_pause_and_hiccups_just_past_the_bound_stay_on_the_loop() -> None:
    # A full collection of a large heap in one forward, then a descheduled thread now and again.
    loop = Loop()
    assert loop.run([(1.0, 2.0), (0.5, 0.012), (2.0, 0.015), (5.0, 0.012)]) == [None] * 4


def test_hiccups_under_the_bound_never_leave_the_loop_nor_do_a_few_past_it() -> None:
    loop = Loop()
    assert loop.run([(0.0005, 0.009)] * 10_000) == [None] * 10_000  # under the bound: not long
    # Past it, one every two seconds for an hour (0.6% of the time), then one of seconds: still on the loop.
    assert loop.run([(2.0, 0.012)] * 1800 + [(2.0, 3.0)]) == [None] * 1801
    # One past it every second holds up the loop for 1.2% of the time: the tenth in ten seconds moves it.
    runs = loop.run([(1.0, 0.012)] * 10)
    assert runs[:-1] == [None] * 9
    assert runs[-1] is not None


def test_long_forwards_spaced_wider_than_the_budgets_share_stay_on_the_loop() -> None:
    # A pause of 300 ms every 40 s: under 1% of the time.
    loop = Loop()
    assert loop.run([(40.0, 0.3)] * 100) == [None] * 100
    # Every 20 s, 300 ms is 1.5% of the time: the second moves it.
    first, second = Loop().run([(20.0, 0.3)] * 2)
    assert first is None
    assert second is not None
