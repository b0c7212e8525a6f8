"""What the user sees while a sweep runs: a rich progress bar per level, or one plain line per level."""

from __future__ import annotations

import sys
import time
from types import TracebackType
from typing import TextIO

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from halfserve.loadtest.stats import LevelResult


def describe(result: LevelResult) -> str:
    """One level in a line: ``bf16 c=8: 812 req/s, 812 rows/s, p50 9.1 ms, p99 12.0 ms, batch 7.8, 0 errors``."""
    p50 = f"{result.p50_ms:.2f}" if result.p50_ms is not None else "-"
    p99 = f"{result.p99_ms:.2f}" if result.p99_ms is not None else "-"
    batch = f"{result.mean_batch_size:.1f}" if result.mean_batch_size is not None else "-"
    flag = " (client-bound)" if result.client_bound else ""
    return (
        f"{result.precision} c={result.concurrency}: {result.req_per_s:,.0f} req/s, {result.rows_per_s:,.0f} rows/s, "
        f"p50 {p50} ms, p99 {p99} ms, batch {batch}, {result.errors} errors{flag}"
    )


class SweepProgress:
    """Progress of a sweep: a live rich bar on a terminal, else a line per finished level on ``stream``."""

    def __init__(self, enabled: bool = True, stream: TextIO | None = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.console = Console(file=self.stream)
        self.live = enabled and self.console.is_terminal
        self._progress: Progress | None = None
        self._task: TaskID | None = None
        self._label = ""
        self._total = 0.0
        self._by_time = False
        self._start = 0.0

    def __enter__(self) -> SweepProgress:
        if self.live:
            self._progress = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                TextColumn("{task.fields[done]:>8,} req"),
                TimeElapsedColumn(),
                console=self.console,
            )
            self._progress.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def note(self, text: str) -> None:
        """A line of status (server starting, client ceiling...)."""
        if self._progress is not None:
            self._progress.console.print(text, markup=False, highlight=False)
        else:
            print(text, file=self.stream, flush=True)

    def start_level(self, label: str, *, duration: float | None, requests: int | None) -> None:
        self._label = label
        self._by_time = duration is not None
        self._total = float(duration if duration is not None else requests or 0)
        self._start = time.monotonic()
        if self._progress is not None:
            self._task = self._progress.add_task(label, total=self._total or None, done=0)

    def update(self, done: int) -> None:
        if self._progress is None or self._task is None:
            return
        completed = min(self._total, time.monotonic() - self._start) if self._by_time else float(done)
        self._progress.update(self._task, completed=completed, done=done)

    def finish_level(self, result: LevelResult) -> None:
        line = describe(result)
        if self._progress is not None and self._task is not None:
            # The finished level leaves the live display and stays as a line above it.
            self._progress.remove_task(self._task)
            self._task = None
        self.note(line)
