"""Where a model's batches run, decided once at load by :func:`choose`: one :class:`Placement` value per engine, from
the server's ``placement`` setting, the model's manifest and device, and, for a CPU model left to ``auto``, its
in-process engine's warm-up timing. Torch-free: the settings name its values.

The choice for a CPU model rests on one comparison: a full batch's forward, timed at warm-up (or given as the
``forward_seconds`` setting), against the event loop's own work on that batch's requests
(:data:`LOOP_SECONDS_PER_ROW` a row). The measurements behind each threshold are in ``docs/benchmarks.md``
("Where batches run").
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Protocol

from halfserve.execution import Compile, Execution, Isolation


class Placement(str, Enum):
    """Where an engine runs its batches."""

    INSTANCE_THREADS = "instance_threads"
    """Each batch on an idle instance's own thread (the default)."""
    EVENT_LOOP = "event_loop"
    """On the event loop's own thread: a forward shorter than the loop's work on its requests, where handing it to a
    thread and back would cost more than it runs."""
    BESIDE_LOOP = "beside_loop"
    """As a traced graph in torch's inter-op pool, launched and collected by the event loop, two batches of up to half
    ``max_batch_size`` in flight: the loop reads and answers one batch's requests while the other runs."""
    INSTANCE_PROCESSES = "instance_processes"
    """Each instance in a process of its own (:mod:`halfserve.isolated`)."""


class PlacementSetting(str, Enum):
    """The server's ``placement`` setting: a :class:`Placement` for every model, or ``auto``."""

    AUTO = "auto"
    """Per model (:func:`choose`): processes where its manifest's ``execution.isolation`` says so, else on CUDA; on a
    CPU, where its warm-up timing says."""
    INSTANCE_THREADS = Placement.INSTANCE_THREADS.value
    EVENT_LOOP = Placement.EVENT_LOOP.value
    BESIDE_LOOP = Placement.BESIDE_LOOP.value
    INSTANCE_PROCESSES = Placement.INSTANCE_PROCESSES.value

    @property
    def placement(self) -> Placement | None:
        """The placement asked for; None for ``auto``."""
        return None if self is PlacementSetting.AUTO else Placement(self.value)


class OnDevice(Protocol):
    """A device as the choice reads it (``torch.device`` answers it)."""

    @property
    def type(self) -> str: ...


LOOP_SECONDS_PER_ROW = 50e-6
"""About what the event loop spends taking and answering a one-row request (measured on a 2-core AMD EPYC; less on
faster cores)."""

BESIDE_LOOP_MIN_SHARE = 0.1
"""The least share of the event loop's work on a batch's requests that its forward must take to run beside the loop
rather than on it: two batches in flight each cost the loop its own launch and collection, about what the forward of
a few rows saves."""

BESIDE_LOOP_MIN_ROWS = 32
"""The smallest full batch (``max_batch_size``) run beside the loop by default: its halves must still batch, and a
tiny forward's fixed cost makes its share of a few rows' loop work look large and unsteady."""


LOOP_STALL_FACTOR = 10.0
"""How many times its warm-up forward of a full batch a forward on the event loop may take before it runs long
(:func:`loop_stall_bound`): a batch of real rows may take a few times longer than the warm-up's zeros (other values, a
half precision's overflow rerun in fp32, a descheduled thread), never tens of times."""

LOOP_STALL_FLOOR_SECONDS = 0.01
"""The least :func:`loop_stall_bound`: a forward placed on the loop is shorter than the loop's work on its rows
(:data:`LOOP_SECONDS_PER_ROW`), so well under a millisecond for most batches, where a pause of the host (the
scheduler's latency period, a collection) alone can reach several ms. Such pauses mostly stay under it, and the few
past it are too rare to reach :data:`LOOP_STALL_BUDGET_SECONDS`; a forward past it held up every other request on the
server for two hundred times the loop's work on one."""

LOOP_STALL_BUDGET_SECONDS = 0.1
"""How long forwards that run long (:func:`loop_stall_bound`), less the longest of them, may hold up the event loop
within :data:`LOOP_STALL_WINDOW_SECONDS` before their model's batches leave it (:class:`LoopStalls`): a tenth of a
liveness probe's one-second timeout, past what the few host pauses over 10 ms sum to in that time."""

LOOP_STALL_WINDOW_SECONDS = 10.0
"""The time within which :data:`LOOP_STALL_BUDGET_SECONDS` applies; over a longer one, long forwards may hold up
the loop for the same share of it (1%)."""


def loop_stall_bound(batch_seconds: float | None) -> float:
    """The longest a forward on the event loop's thread may take before it runs long (:class:`LoopStalls`):
    :data:`LOOP_STALL_FACTOR` times the warm-up's forward of a full batch (``batch_seconds``; None where warm-up did
    not time one), and never under :data:`LOOP_STALL_FLOOR_SECONDS`."""
    if batch_seconds is None:
        return LOOP_STALL_FLOOR_SECONDS
    return max(LOOP_STALL_FACTOR * batch_seconds, LOOP_STALL_FLOOR_SECONDS)


@dataclass(frozen=True)
class StallRun:
    """The latest forwards that ran long on the event loop, which together held it up past their budget
    (:class:`LoopStalls`)."""

    count: int
    seconds: float
    """Their durations' sum."""
    longest: float
    """The longest one's duration, which the budget leaves out."""
    span: float
    """From the first one's start to the last one's end (seconds)."""


class LoopStalls:
    """Whether a model's forwards on the event loop hold it up for so long that its batches should leave it.

    A forward runs long past ``bound`` (:func:`loop_stall_bound`). The model leaves the loop once its latest forwards
    that ran long, less the longest of them, took more than :data:`LOOP_STALL_BUDGET_SECONDS` together, and more than
    1% of the time from the first one's start where that is past :data:`LOOP_STALL_WINDOW_SECONDS`:

    - not one forward alone, however long: a pause of the host (a full collection of a large heap, a thread
      descheduled on a busy machine) makes one forward long, and leaving the loop would cost every later batch its
      hand-over to a thread; an input that makes a forward slow does so again. The longest is left out rather than
      two forwards asked for, so that such a pause and a hiccup just past the bound do not add up to a move;
    - a budget, not a bound on each forward: forwards of 45 ms each, under a bound that a pause could not reach, held
      up ``/health`` ten times over as long as they came;
    - a budget that grows with the time: two forwards of 6 s with a few seconds between, or a minute, held up the loop
      for much of that time, and a budget for 10 s alone would never see them together.

    Long forwards from before a stretch of over :data:`LOOP_STALL_WINDOW_SECONDS` in which long forwards (the longest
    counted) took no more than 1% of the time are forgotten, and at most :attr:`KEPT` are kept. Measured after each
    forward (what one will cost is known only once it ran, and nothing stops one running); the caller compares each
    forward with :attr:`bound` before it calls :meth:`note`, so a short forward costs a compare.
    """

    KEPT = 64
    """The most long forwards remembered: a bound on the memory, and on the work of a :meth:`note`, where long forwards
    keep coming at about 1% of the time beside one far longer that keeps them from being forgotten."""

    def __init__(self, bound: float) -> None:
        self.bound = bound
        """A forward longer than this (seconds) runs long."""
        self._long: deque[tuple[float, float]] = deque()
        """Each long forward remembered: its start and duration (seconds), the latest last."""

    def note(self, now: float, seconds: float) -> StallRun | None:
        """A forward that took ``seconds`` ended at ``now`` (a monotonic clock's reading in seconds, later than the
        last one noted): the run of latest long forwards past its budget, where there is one (its model's batches
        then leave the loop), else None."""
        if seconds <= self.bound:
            return None
        self._long.append((now - seconds, seconds))
        share = LOOP_STALL_BUDGET_SECONDS / LOOP_STALL_WINDOW_SECONDS
        total = longest = 0.0
        for count, (start, duration) in enumerate(reversed(self._long), start=1):
            total += duration
            longest = max(longest, duration)
            span = now - start
            if total - longest > max(LOOP_STALL_BUDGET_SECONDS, share * span):
                return StallRun(count=count, seconds=total, longest=longest, span=span)
        while len(self._long) > self.KEPT or (
            len(self._long) > 1
            and now - self._long[0][0] > LOOP_STALL_WINDOW_SECONDS
            and total <= share * (now - self._long[0][0])
        ):
            total -= self._long.popleft()[1]
        return None


class Timed(Protocol):
    """What :func:`choose` reads of an engine: its device and instances, and what warm-up timed
    (:meth:`halfserve.engine.core.Engine.settle_threads`)."""

    @property
    def device(self) -> OnDevice: ...
    @property
    def threads(self) -> int | None: ...
    @property
    def loop_bound(self) -> bool | None: ...
    @property
    def batch_seconds(self) -> float | None: ...
    @property
    def batch_rows(self) -> int: ...
    @property
    def cores(self) -> int: ...

    @property
    def instance_count(self) -> int: ...

    @property
    def traceable(self) -> bool: ...


def loop_bound(batch_seconds: float, rows: int) -> bool:
    """Whether a forward of ``rows`` one-row requests taking ``batch_seconds`` is shorter than the event loop's work
    on those requests: then the loop, not the forward, bounds throughput."""
    return batch_seconds < rows * LOOP_SECONDS_PER_ROW


def intra_op_threads(batch_seconds: float, rows: int, cores: int) -> int:
    """torch intra-op threads for an engine on ``cores`` whose forward of ``rows`` takes ``batch_seconds`` on all of
    them: every core but one when the forward is :func:`loop_bound` (the loop's core is the scarce one), every core
    otherwise (the forward bounds throughput)."""
    if cores > 1 and loop_bound(batch_seconds, rows):
        return cores - 1
    return cores


def _on_event_loop(engine: Timed, forced: bool | None) -> bool:
    """As ``forced`` says, else where the forward is :func:`loop_bound` and settled on one intra-op thread; only on a
    CPU, with one instance. One thread: a forward on more would make the loop's thread an OpenMP master with a pool of
    its own beside the instance's, and GNU OpenMP stops spinning once the pools outnumber the cores."""
    if engine.device.type != "cpu" or engine.instance_count != 1:
        return False
    if forced is None:
        return bool(engine.loop_bound) and engine.threads == 1
    return forced


def _beside_loop(engine: Timed, forced: bool | None) -> bool:
    """As ``forced`` says, else where the forward would run on the loop and takes at least
    :data:`BESIDE_LOOP_MIN_SHARE` of the loop's work on a full batch of :data:`BESIDE_LOOP_MIN_ROWS` or more, with
    another core for the graph; only an engine that can be traced (:attr:`halfserve.engine.core.Engine.traceable`)."""
    if not engine.traceable:
        return False
    if forced is not None:
        return forced
    if not _on_event_loop(engine, None) or engine.batch_seconds is None:
        return False
    if engine.cores < 2:  # no other core for the graph to run on: it would only add its launches to the loop's work
        return False
    if engine.batch_rows < BESIDE_LOOP_MIN_ROWS:
        return False
    return engine.batch_seconds >= BESIDE_LOOP_MIN_SHARE * engine.batch_rows * LOOP_SECONDS_PER_ROW


def choose(
    setting: PlacementSetting, execution: Execution, device: OnDevice, measure: Callable[[], Timed]
) -> Placement:
    """Where a model's batches run: the one decision, taken once per engine built.

    ``setting`` is the server's (``auto``: per model); then the manifest's ``execution.isolation``, else processes on
    CUDA (where an instance's many torch calls per batch would each wait for the GIL the event loop holds) and threads
    on a CPU (where a process per instance costs a copy per batch and a copy of the weights, and the forward, not the
    GIL, is what takes the time). In this process, ``measure`` builds the engine, warms and times it (the repository's,
    which serves the same engine), and its timing decides: beside the loop, on it, or on its instances' threads. A
    placement asked for is taken where the engine can take it (the event loop: a CPU engine with one instance; beside
    it: an engine that traces, :attr:`halfserve.engine.core.Engine.traceable`), else decided as for ``auto``.
    """
    wanted = setting.placement
    if wanted is None and (execution.isolation or _isolation_on(device)) is Isolation.PROCESS:
        wanted = Placement.INSTANCE_PROCESSES
    if wanted is Placement.INSTANCE_PROCESSES:
        return wanted
    return in_process(measure(), wanted)


def _isolation_on(device: OnDevice) -> Isolation:
    return Isolation.PROCESS if device.type == "cuda" else Isolation.THREAD


def in_process(engine: Timed, wanted: Placement | None, traced: bool = True) -> Placement:
    """Where ``engine`` (instance threads, after warm-up) runs its batches in this process: ``wanted`` where it can,
    else (or for ``None``) as its timing says; never beside the loop where ``traced`` is false (a model whose trace
    was refused)."""
    on_loop = {Placement.EVENT_LOOP: True, Placement.INSTANCE_THREADS: False}.get(wanted) if wanted else None
    beside = wanted is Placement.BESIDE_LOOP if wanted else None
    if traced and _beside_loop(engine, beside):
        return Placement.BESIDE_LOOP
    if _on_event_loop(engine, on_loop):
        return Placement.EVENT_LOOP
    return Placement.INSTANCE_THREADS


def pads_to_buckets(execution: Execution, device: OnDevice) -> bool:
    """Whether an engine pads batches to bucket sizes: as the manifest says, else on CUDA (fixed shapes for cuDNN and
    CUDA graphs) and wherever the forward is compiled (a compiled forward runs fixed shapes)."""
    if execution.pad_to_bucket is not None:
        return execution.pad_to_bucket
    return device.type == "cuda" or execution.compile in (Compile.INDUCTOR, Compile.AOTI)


def available_cores() -> int:
    """Every core this process may run on (its affinity, which a container's CPU set narrows): torch's intra-op
    threads when none are set, before each engine settles its own
    (:meth:`halfserve.engine.core.Engine.settle_threads`)."""
    return len(os.sched_getaffinity(0))
