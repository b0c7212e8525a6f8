"""The parent's handle on the client process(es): start them, hand them request templates, run levels, stop them.

The load itself is generated in :mod:`halfserve.loadtest.worker`, in processes of their own, so the parent's
orchestration, progress bar and statistics requests never compete with the load generator's event loop.
"""

from __future__ import annotations

import contextlib
import queue
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from itertools import accumulate
from types import TracebackType
from typing import IO, Any

import orjson

from halfserve.loadtest import LoadtestError
from halfserve.loadtest.payload import RequestTemplate
from halfserve.loadtest.process import child_env
from halfserve.loadtest.stats import LevelSample

STOP_TIMEOUT_S = 10.0


def split(total: int, parts: int) -> list[int]:
    """``total`` spread over ``parts`` as evenly as possible, larger shares first: ``split(5, 2) == [3, 2]``."""
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


class _Worker:
    """One client process and a thread that forwards its stdout lines to a queue."""

    def __init__(self, index: int, base_url: str, timeout: float, loop: str, inbox: queue.Queue[Any]) -> None:
        self.index = index
        # Held for the process's lifetime and closed in stop(); read back only to explain a failure.
        self._stderr: IO[bytes] = tempfile.TemporaryFile()  # noqa: SIM115
        cmd = [sys.executable, "-m", "halfserve.loadtest.worker", "--url", base_url, "--timeout", str(timeout)]
        self.proc = subprocess.Popen(
            [*cmd, "--loop", loop],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            env=child_env(),
            # Its own session: Ctrl-C reaches the parent only, which then stops the client cleanly.
            start_new_session=True,
        )
        self._reader = threading.Thread(target=self._read, args=(inbox,), daemon=True, name=f"loadtest-client-{index}")
        self._reader.start()

    def _read(self, inbox: queue.Queue[Any]) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                msg = orjson.loads(line)
            except orjson.JSONDecodeError:
                msg = {"error": f"unexpected output: {line[:200]!r}"}
            inbox.put((self.index, msg))
        inbox.put((self.index, None))

    def write(self, msg: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(orjson.dumps(msg) + b"\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise LoadtestError(f"the client process exited: {self.failure()}") from None

    def failure(self) -> str:
        """Why the process stopped: its exit code and the end of its stderr."""
        try:
            code = self.proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            code = None
        self._stderr.seek(0)
        tail = self._stderr.read()[-2000:].decode(errors="replace").strip()
        return f"exit code {code}" + (f"; stderr: {tail}" if tail else "")

    def stop(self, force: bool = False) -> None:
        """Close its stdin so it exits after the current command; ``force`` terminates it at once instead."""
        if force and self.proc.poll() is None:
            self.proc.terminate()
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            with contextlib.suppress(BrokenPipeError):
                self.proc.stdin.close()
        try:
            self.proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        # The reader sees EOF once the process is gone; only then is its pipe safe to close.
        self._reader.join(timeout=STOP_TIMEOUT_S)
        if self.proc.stdout is not None and not self._reader.is_alive():
            self.proc.stdout.close()
        self._stderr.close()


class LoadClient:
    """``processes`` client processes sending load to ``base_url``; virtual users are split between them."""

    def __init__(self, base_url: str, *, processes: int = 1, timeout: float = 30.0, loop: str = "uvloop") -> None:
        if processes < 1:
            raise LoadtestError(f"--client-processes: expected at least 1, got {processes}")
        self._inbox: queue.Queue[tuple[int, dict[str, Any] | None]] = queue.Queue()
        self._workers: list[_Worker] = []
        self.loop = ""
        try:
            for i in range(processes):
                self._workers.append(_Worker(i, base_url, timeout, loop, self._inbox))
            for _ in self._workers:
                self.loop = str(self._receive()[1].get("loop"))
        except BaseException:
            self.close(force=True)
            raise

    def _receive(self) -> tuple[int, dict[str, Any]]:
        index, msg = self._inbox.get()
        worker = self._workers[index]
        if msg is None:
            raise LoadtestError(f"the client process exited: {worker.failure()}")
        if "error" in msg:
            raise LoadtestError(f"the client process failed:\n{msg['error']}")
        return index, msg

    def add_template(self, name: str, template: RequestTemplate) -> None:
        """Ship a request template to every client process (encoded once here, reused for every request there)."""
        payload = {"op": "template", "name": name, "template": template.to_message()}
        for w in self._workers:
            w.write(payload)
        for _ in self._workers:
            self._receive()

    def run(
        self,
        template: str,
        concurrency: int,
        *,
        duration: float | None = None,
        requests: int | None = None,
        on_progress: Callable[[int], None] | None = None,
    ) -> LevelSample:
        """One level: ``concurrency`` virtual users for ``duration`` seconds or ``requests`` requests in all."""
        if (duration is None) == (requests is None):
            raise ValueError("give exactly one of duration and requests")
        users = split(concurrency, len(self._workers))
        # accumulate(initial=0) yields one offset more than there are workers: zip stops at the workers.
        offsets = accumulate(users, initial=0)
        busy = [(w, n, first) for w, n, first in zip(self._workers, users, offsets, strict=False) if n > 0]
        shares: list[int | None] = [None] * len(busy)
        if requests is not None:
            shares = [share for share in split(requests, len(busy))]
        active: set[int] = set()
        for (w, n, first), share in zip(busy, shares, strict=True):
            if share == 0:
                continue
            cmd = {"op": "run", "template": template, "concurrency": n, "first_user": first}
            w.write({**cmd, "duration": duration, "requests": share})
            active.add(w.index)
        progress = dict.fromkeys(active, 0)
        parts: dict[int, LevelSample] = {}
        while len(parts) < len(active):
            index, msg = self._receive()
            if "progress" in msg:
                progress[index] = int(msg["progress"])
                if on_progress is not None:
                    on_progress(sum(progress.values()))
            elif "result" in msg:
                parts[index] = LevelSample.from_message(msg["result"])
        return LevelSample.merge([parts[i] for i in sorted(parts)])

    def close(self, force: bool = False) -> None:
        """Stop the client processes; ``force`` (on an error or Ctrl-C) does not wait for a level to finish."""
        for w in self._workers:
            w.stop(force)
        self._workers = []

    def __enter__(self) -> LoadClient:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close(force=exc is not None)
