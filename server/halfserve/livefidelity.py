"""Live fidelity: a sampled share of the rows a model answers in a half precision, rerun in fp32 off the request path
and compared with what was answered, over a window of the last rows compared.

The fidelity check at load (:mod:`halfserve.fidelity`) sees only the version's samples, once. Real traffic drifts
(other inputs, other scales, a camera or tokenizer change upstream), so a model that passed at load may disagree with
fp32 later. Here:

* the **tap** (:meth:`LiveFidelity.tap`) wraps a model's batch runner: when a batch's outputs come back (on the event
  loop, in the process that batches, whether the instances are threads or processes), :class:`Sampler` picks about
  ``rate`` of its rows, and only those are copied, inputs and outputs, into a bounded queue. A full queue drops
  them (counted). The tap never raises into the batch and never waits: the request is answered as if it were not
  there;
* each engine tapped starts on **probation**: its first rows answered are all sampled until ``min_rows`` of them are
  compared or queued, then ``rate`` applies. At the default rate a model whose half precision does not hold on the
  real inputs (measured at load on random samples, on calibration samples unlike the traffic, or switched to a half
  precision unmeasured) would serve about ``min_rows / rate`` rows before its first decision; on probation it serves
  about ``min_rows``. It applies to every engine: it costs ``min_rows`` fp32 reruns of one row, held to the CPU share
  like any others, and no more rows are copied than it needs, so a flood during probation copies no more than a
  trickle;
* one **worker thread** per model reruns the queued rows through the fp32 weights already kept on the host
  (``loaded.module``, as the check at load does), on one intra-op thread, and then waits :func:`pause` so that the
  reruns take at most ``cpu_share`` of one core. On a GPU the reference runs on the host CPU too: it costs no device
  memory, and host CPU time bounded by the share;
* the figures are those of the check at load, per output kind (:func:`halfserve.fidelity.rows`), over a
  :class:`Window` of the last rows compared. Once it holds ``min_rows`` rows and falls below the model's bar, the
  model's ``on_shortfall`` is told once (the repository demotes it, or only alerts). The inputs of the last rows
  compared are kept (:meth:`LiveFidelity.recent`), so a demotion can search a mixed-precision plan on real traffic.

Models whose outputs have a variable dimension are not sampled (a row rerun alone is padded to its own length, not
its batch's, so its padding positions would not compare).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import queue
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from halfserve import fidelity
from halfserve.engine.core import Engine
from halfserve.engine.intraop import set_intra_op_threads
from halfserve.manifest import Manifest, Precision
from halfserve.serving import Outcome, Output
from halfserve.settings import LiveFidelityAction, Settings
from halfserve.store import LoadedModel

log = logging.getLogger(__name__)

EngineRunner = Callable[[list[np.ndarray]], "asyncio.Future[list[Outcome]]"]
"""An engine's ``run``: a batch's chunks to the future of their outcomes (the runner contract, as engines keep it)."""

RECENT_BYTES = 64 * 2**20
"""The sampled inputs kept for a mixed-precision search on live rows (:meth:`LiveFidelity.recent`): the last window's
rows, at most this many bytes of them."""

QUEUE_ENTRIES = 256
"""Batches' sampled rows waiting for their rerun, per model; more are dropped (counted): at the default rate a queue
this long means the reruns are far behind (the CPU share is too small for the traffic), not a burst."""


class Sampler:
    """Which rows of the batches answered are sampled: each with probability ``rate``, independently.

    The gap to the next sampled row is drawn once per sampled row (geometric), so a batch with none costs a
    subtraction, not a random draw per row. ``uniform`` gives numbers in [0, 1) (tests pass a made-up source)."""

    def __init__(self, rate: float, uniform: Callable[[], float] = random.random) -> None:
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"rate must be within 0..1, got {rate}")
        self.rate = rate
        self._uniform = uniform
        self._gap = self._draw()

    def _draw(self) -> float:
        """Rows to pass over before the next sampled one."""
        if self.rate >= 1.0:
            return 0
        if self.rate <= 0.0:
            return math.inf
        return math.floor(math.log1p(-self._uniform()) / math.log1p(-self.rate))

    def take(self, rows: int) -> list[int]:
        """The indices of the next ``rows`` rows that are sampled."""
        picked: list[int] = []
        at = self._gap
        while at < rows:
            picked.append(int(at))
            at += 1 + self._draw()
        self._gap = at - rows
        return picked


def pause(seconds: float, share: float) -> float:
    """How long to wait after a rerun that took ``seconds`` so the reruns take ``share`` of the time."""
    return seconds * (1.0 - share) / share


class Window:
    """The figures of the last ``size`` rows compared (:func:`halfserve.fidelity.rows`, one row per entry)."""

    def __init__(self, size: int) -> None:
        self._rows: deque[fidelity.Rows] = deque(maxlen=size)

    def __len__(self) -> int:
        return len(self._rows)

    def add(self, measured: fidelity.Rows) -> None:
        for i in range(len(measured)):
            self._rows.append(_row(measured, i))

    def clear(self) -> None:
        self._rows.clear()

    def figures(self, precision: Precision) -> fidelity.Fidelity | None:
        """The figures over the window (None while it is empty)."""
        if not self._rows:
            return None
        return fidelity.summarize(fidelity.Rows.concat(list(self._rows)), precision, fidelity.Source.LIVE)


def _row(measured: fidelity.Rows, i: int) -> fidelity.Rows:
    def one(a: np.ndarray | None) -> np.ndarray | None:
        return None if a is None else a[i : i + 1]

    return fidelity.Rows(
        one(measured.top1),
        one(measured.cosine),
        measured.abs_error[i : i + 1],
        one(measured.rel_diff),
        one(measured.rel_scale),
    )


@dataclass(frozen=True)
class LiveSettings:
    """The server's live fidelity settings (``live_fidelity_*``)."""

    rate: float
    cpu_share: float
    window: int
    min_rows: int
    action: LiveFidelityAction
    probation: int | None = None
    """Rows of a newly tapped engine that are all sampled (see the module); ``None``: ``min_rows``, the rows of its
    first decision."""

    @property
    def probation_rows(self) -> int:
        return self.min_rows if self.probation is None else self.probation

    @staticmethod
    def of(settings: Settings) -> LiveSettings:
        return LiveSettings(
            settings.live_fidelity_rate,
            settings.live_fidelity_cpu_share,
            settings.live_fidelity_window,
            settings.live_fidelity_min_rows,
            settings.live_fidelity_action,
        )


def samples_live(manifest: Manifest, precision: Precision, settings: LiveSettings) -> bool:
    """Whether rows a model answers in ``precision`` are sampled: a half precision, a rate above 0, and rows that can
    be rerun alone and compared (none of its outputs has a variable dimension)."""
    return precision is not Precision.FP32 and settings.rate > 0 and not any(t.variable for t in manifest.outputs)


class Sampled:
    """One batch's sampled rows: inputs as the engine takes them, outputs as it gave them, their precision, and which
    tap (:attr:`LiveFidelity.taps`) sampled them."""

    __slots__ = ("inputs", "outputs", "precision", "tap")

    def __init__(self, inputs: np.ndarray, outputs: np.ndarray, precision: Precision, tap: int) -> None:
        self.inputs, self.outputs, self.precision, self.tap = inputs, outputs, precision, tap


class LiveFidelity:
    """Live fidelity of one served model: its tap, queue, worker thread, fp32 reference and window (see the module).

    ``on_shortfall`` is called once, from the worker thread, with the reason when the window first falls below
    ``held_to``; it must be thread-safe (the repository hands it to the event loop)."""

    def __init__(
        self,
        name: str,
        loaded: LoadedModel,
        held_to: fidelity.Bar,
        settings: LiveSettings,
        on_shortfall: Callable[[str], None],
        uniform: Callable[[], float] = random.random,
    ) -> None:
        self.name = name
        self.loaded = loaded
        self.held_to = held_to
        self.settings = settings
        self.on_shortfall = on_shortfall
        self.sampler = Sampler(settings.rate, uniform)
        self.window = Window(settings.window)
        self.rows_compared = 0
        """Rows rerun in fp32 and compared since the model was loaded."""
        self.rows_dropped = 0
        """Sampled rows dropped, the queue being full (or the rerun failing)."""
        self.shortfalls = 0
        """Times the window fell below the bar (each a demotion or an alert)."""
        self.shortfall: str | None = None
        """Why the window fell below the bar, the last time it did (None: it has not)."""
        self.rerun_seconds = 0.0
        """Time the fp32 reruns took, all together."""
        self.precision: Precision | None = None
        """The half precision whose rows the window holds (None: none tapped yet)."""
        self.taps = 0
        """Engines tapped so far: rows sampled from an earlier one are not added to the window."""
        self._tap_compared = 0
        """Rows of the current tap compared: its probation ends once they are ``settings.probation_rows``."""
        self._tap_queued = 0
        """Rows of the current tap waiting in the queue for their rerun."""
        self._recent: deque[np.ndarray] | None = None
        """The inputs of the last rows compared (see :data:`RECENT_BYTES`), made on the first."""
        self._queue: queue.Queue[Sampled | None] = queue.Queue(QUEUE_ENTRIES)
        self._lock = threading.Lock()
        self._reference: Engine | None = None
        self._thread: threading.Thread | None = None
        self._closed = threading.Event()
        """Set by :meth:`close`: the worker's pause after a rerun ends at once."""

    def tap(self, runner: EngineRunner, precision: Precision) -> EngineRunner:
        """``runner`` (a new engine's), with the rows of each batch it answers offered to sampling. It starts an empty
        window: rows of another engine (another precision, or one the model was demoted from) say nothing of it."""
        with self._lock:
            self.taps += 1
            self.window.clear()
            self.shortfall = None
            self.precision = precision
            self._tap_compared = self._tap_queued = 0
            tap = self.taps

        def run(chunks: list[np.ndarray]) -> asyncio.Future[list[Outcome]]:
            answer = runner(chunks)
            # Told before the batcher that awaits it (callbacks run in the order they were added): the sampled rows
            # are copied before the requests are answered, whatever memory the outputs are in.
            answer.add_done_callback(functools.partial(self._answered, chunks, precision, tap))
            return answer

        return run

    def _answered(
        self, chunks: list[np.ndarray], precision: Precision, tap: int, answer: asyncio.Future[list[Outcome]]
    ) -> None:
        if not answer.cancelled() and answer.exception() is None:
            self.offer(chunks, answer.result(), precision, tap)

    def offer(self, chunks: Sequence[np.ndarray], outcomes: Sequence[Outcome], precision: Precision, tap: int) -> None:
        """Copy the sampled rows of a batch that ``tap`` answered in ``precision`` into the queue; called on the event
        loop, so it only copies."""
        try:
            self._offer(chunks, outcomes, precision, tap)
        except Exception:  # never the request's problem: the row is lost to the window, not the answer
            log.exception("model %s: live fidelity could not sample a batch", self.name)

    def _offer(self, chunks: Sequence[np.ndarray], outcomes: Sequence[Outcome], precision: Precision, tap: int) -> None:
        rows = sum(len(c) for c in chunks)
        picked = self.sampler.take(rows)
        owed = self._probation_owed(tap)
        if owed:
            picked = sorted(set(range(min(owed, rows))).union(picked))
        if not picked or self._closed.is_set():
            return
        inputs, outputs = [], []
        start = 0
        for chunk, outcome in zip(chunks, outcomes, strict=True):
            mine = [i - start for i in picked if start <= i < start + len(chunk)]
            start += len(chunk)
            if not mine or isinstance(outcome, Exception):
                continue
            out, by = outcome if isinstance(outcome, Output) else (outcome, None)
            if (by or precision) is not precision or len(out) != len(chunk):
                continue  # rerun in fp32 after an overflow: nothing to compare
            inputs.append(chunk[mine])
            outputs.append(out[mine])
        if not inputs:
            return
        sampled = Sampled(np.concatenate(inputs), np.concatenate(outputs), precision, tap)
        try:
            self._queue.put_nowait(sampled)
        except queue.Full:
            self.rows_dropped += len(sampled.inputs)
            return
        with self._lock:
            if tap == self.taps:
                self._tap_queued += len(sampled.inputs)

    def _probation_owed(self, tap: int) -> int:
        """Rows ``tap`` still samples whatever the rate: its probation's, less those compared or queued already."""
        with self._lock:
            if tap != self.taps:
                return 0
            return max(0, self.settings.probation_rows - self._tap_compared - self._tap_queued)

    def start(self) -> None:
        """Start the worker thread that reruns the queued rows (until then they wait in the queue)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name=f"live-fidelity-{self.name}", daemon=True)
            self._thread.start()

    def _work(self) -> None:
        # One intra-op thread: the share caps one core's time, and the serving engines keep the others.
        set_intra_op_threads(1)
        while (sampled := self._queue.get()) is not None:
            self._closed.wait(pause(self.rerun(sampled), self.settings.cpu_share))

    def rerun(self, sampled: Sampled) -> float:
        """:meth:`compare` a batch's sampled rows taken from the queue (a failure counts them dropped); the seconds it
        took. Blocks (the worker thread's work)."""
        started = time.perf_counter()
        try:
            self.compare(sampled)
        except Exception:
            self.rows_dropped += len(sampled.inputs)
            log.exception("model %s: live fidelity could not rerun %d row(s) in fp32", self.name, len(sampled.inputs))
        with self._lock:
            if sampled.tap == self.taps:  # out of the queue: a probation still owed rows samples them again
                self._tap_queued = max(0, self._tap_queued - len(sampled.inputs))
        took = time.perf_counter() - started
        self.rerun_seconds += took
        return took

    def compare(self, sampled: Sampled) -> None:
        """Rerun ``sampled``'s rows in fp32, add their figures to the window, and tell ``on_shortfall`` when it first
        falls below the bar. Blocks (the worker thread's work; tests call it directly)."""
        if self._reference is None:
            self._reference = fidelity.fp32_reference(self.loaded)
        want = self._reference.forward(sampled.inputs)
        measured = fidelity.rows(want, sampled.outputs, self.loaded.manifest)
        with self._lock:
            if sampled.tap != self.taps:
                return  # sampled from an engine since replaced
            self.window.add(measured)
            self.rows_compared += len(measured)
            self._tap_compared += len(measured)
            self._keep(sampled.inputs)
            if self.shortfall is not None or len(self.window) < self.settings.min_rows:
                return
            figures = self.window.figures(sampled.precision)
            reason = None if figures is None else fidelity.shortfall(figures, self.held_to)
            if reason is None:
                return
            self.shortfall = reason
            self.shortfalls += 1
        self.on_shortfall(reason)

    def _keep(self, inputs: np.ndarray) -> None:
        if self._recent is None:
            fits = RECENT_BYTES // max(inputs[0].nbytes, 1) if len(inputs) else 1
            self._recent = deque(maxlen=max(1, min(self.settings.window, fits)))
        self._recent.extend(inputs)

    def recent(self) -> np.ndarray | None:
        """The inputs of the last rows compared, as the engine takes them (None: none yet): real traffic, where a
        mixed-precision plan can be searched once the window falls below the bar (the repository does)."""
        with self._lock:
            return np.stack(list(self._recent)) if self._recent else None

    @property
    def action(self) -> str:
        """What a window below the bar does (``demote`` or ``alert``)."""
        return self.settings.action.value

    @property
    def window_rows(self) -> int:
        """Rows in the window now."""
        return len(self.window)

    @property
    def probation_rows_left(self) -> int:
        """Rows the engine served now must still have compared before its probation ends (0: sampled at ``rate``)."""
        with self._lock:
            return max(0, self.settings.probation_rows - self._tap_compared)

    def figures(self) -> fidelity.Fidelity | None:
        """The window's figures now (None while it is empty)."""
        with self._lock:
            return None if self.precision is None else self.window.figures(self.precision)

    def describe(self) -> dict[str, object]:
        """What ``/models`` shows under ``live_fidelity``."""
        figures = self.figures()
        s = self.settings
        return {
            "rate": s.rate,
            "cpu_share": s.cpu_share,
            "action": s.action.value,
            "window": s.window,
            "min_rows": s.min_rows,
            "window_rows": len(self.window),
            "probation_rows_left": self.probation_rows_left,
            "rows_compared": self.rows_compared,
            "rows_dropped": self.rows_dropped,
            "rerun_seconds": round(self.rerun_seconds, 3),
            "figures": None if figures is None else figures.as_dict(),
            "shortfall": self.shortfall,
        }

    def close(self) -> None:
        """Stop the worker (after its current rerun) and release the fp32 reference; blocks, so call it off the event
        loop."""
        self._closed.set()
        thread = self._thread
        if thread is not None:
            with contextlib.suppress(queue.Full):
                while True:  # what is still queued is not rerun: the model is going
                    try:
                        self._queue.get_nowait()
                    except queue.Empty:
                        break
                self._queue.put_nowait(None)
            thread.join()
        if self._reference is not None:
            self._reference.close()
            self._reference = None
