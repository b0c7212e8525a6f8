"""Supervision of a model's instance processes, seen from the server process: their start and readiness, the watchdog
on a batch in hand, restarts (with a backoff for processes that die while starting), and their end.

What crosses to a process (its socket, its shared memory, the frames) is :mod:`halfserve.isolated.wire`'s; this
module knows a process only as :class:`Supervised`, and starts one only through the ``spawn`` it is given.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import multiprocessing.process
import signal
import threading
import time
from collections.abc import Callable
from typing import Any, Generic, Protocol, TypeVar

from halfserve.engine.protocol import EngineError

log = logging.getLogger(__name__)

EXIT_TIMEOUT_S = 10.0
"""How long a closing instance process has to finish its batch and exit before it is killed."""
KILL_TIMEOUT_S = 5.0
"""How long a process past :data:`EXIT_TIMEOUT_S` has to end on SIGTERM, then on SIGKILL (one stopped takes only
SIGKILL)."""
RESPAWN_DELAYS_S = (0.5, 2.0, 10.0, 30.0)
"""Waits before restarting an instance process that died while starting, one per such death in a row (the last
repeats): a process that cannot start is not restarted in a tight loop. One that dies serving (killed by a request,
or hung and killed) is restarted at once: its death says nothing of the next one's start."""


class Supervised(Protocol):
    """An instance process as its supervisor sees it."""

    index: int
    process: multiprocessing.process.BaseProcess | None
    alive: bool
    """Whether it said it is ready and its socket is still open."""
    hung: bool
    """Whether the watchdog killed it."""
    ready: asyncio.Future[dict[str, Any]]
    """Set with its ready message (its engine's info), or failed with why it did not start."""

    @property
    def pid(self) -> int | None: ...

    def stop(self) -> None:
        """Tell it to exit once its batch in hand is answered."""
        ...


P = TypeVar("P", bound=Supervised)


def end(process: multiprocessing.process.BaseProcess, timeout: float, what: str) -> int | None:
    """Wait up to ``timeout`` for ``process`` to exit, then terminate it, then kill it; then release its pipe and
    sentinel (``Process.close``) now, not when a garbage collection finds it. Returns its exit code (None: it would
    not end)."""
    process.join(timeout)
    for step in (process.terminate, process.kill):
        if not process.is_alive():
            break
        log.error(
            "%s (pid %s) did not exit; %s",
            what,
            process.pid,
            "terminating it" if step == process.terminate else "killing it",
        )
        step()
        process.join(KILL_TIMEOUT_S)
    if process.is_alive():
        return None
    code = process.exitcode
    process.close()
    return code


def ending(code: int | None) -> str:
    """How a process with exit code ``code`` ended, for a log line (a negative code is the signal that killed it)."""
    if code is None:
        return "exited (its exit code unknown)"
    if code >= 0:
        return f"exited with code {code}"
    try:
        return f"was killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"was killed by signal {-code}"


class Watchdog:
    """Kills an instance process whose batch in hand is not answered within ``timeout`` seconds
    (``instance_batch_timeout``): a process stopped or stuck would hold its requests (and readiness) for ever. Killed,
    it is restarted and its batch rerun, as for any process that dies serving."""

    def __init__(self, model: str, timeout: float) -> None:
        self.model, self.timeout = model, timeout
        self._timer: asyncio.TimerHandle | None = None

    def arm(self, instance: Supervised, extra: float = 0.0) -> None:
        """Start the wait for ``instance``'s answer to the batch just sent: ``extra`` seconds more than the timeout
        for a batch that runs more than the forward (a handler's calls, each bounded by its own limit)."""
        self.disarm()
        self._timer = asyncio.get_running_loop().call_later(self.timeout + extra, self._kill, instance)

    def disarm(self) -> None:
        """The batch was answered, or the process is gone."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _kill(self, instance: Supervised) -> None:
        self._timer = None
        if instance.process is None or not instance.alive:
            return
        log.error(
            "instance process %d of model %s (pid %s) did not answer a batch within %gs; killing it",
            instance.index,
            self.model,
            instance.pid,
            self.timeout,
        )
        instance.hung = True
        instance.process.kill()


class Supervisor(Generic[P]):
    """Starts a model's instance processes, restarts each one that dies, and ends them.

    ``spawn(index)`` starts instance process ``index`` (ready once its :attr:`Supervised.ready` is set);
    ``restarted(instance)`` is told of each restarted process once it is warm; ``none_left(why, retry_after)`` is told
    when a restart failed and no other process is up to take the batches waiting meanwhile, with the seconds until
    the next start. A process not ready within ``start_timeout`` seconds (``instance_start_timeout``) is killed, and
    its start failed.
    """

    def __init__(
        self,
        model: str,
        spawn: Callable[[int], P],
        restarted: Callable[[P], None],
        none_left: Callable[[str, int], None],
        start_timeout: float,
    ) -> None:
        self.model = model
        self._spawn, self._restarted, self._none_left = spawn, restarted, none_left
        self.start_timeout = start_timeout
        self.instances: list[P] = []
        self.crashes = 0
        """Instance processes that died while starting, in a row (the restart's backoff)."""
        self.restarts = 0
        """Instance processes restarted after dying while serving (killed by a request, or hung and killed)."""
        self.start_failures = 0
        """Restarted instance processes that died before they were ready."""
        self.closing = False
        """Set once the engine closes: no process is restarted from then on."""
        self._respawning: set[asyncio.Task[None]] = set()
        self._due: dict[int, float] = {}
        """When each process waiting out its back-off starts again (the loop's time), by index."""
        self._starting: set[int] = set()
        """The processes being restarted now (past any back-off), by index."""
        self.last_failure = ""
        """Why the last restart failed."""
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()

    async def start(self, count: int) -> list[dict[str, Any]]:
        """Start ``count`` instance processes and wait until every one is ready: their ready messages, in order.
        Raises the error of the first that failed to start (:class:`~halfserve.engine.protocol.EngineError`), or one
        naming a process not ready within the start timeout."""
        self.instances = [self._spawn(i) for i in range(count)]
        return await self._ready(self.instances)

    async def _ready(self, instances: list[P]) -> list[dict[str, Any]]:
        for instance in instances:
            # Read here whatever happens: a start given up on (one of several failed, or the timeout) may still fail.
            instance.ready.add_done_callback(_retrieve)
        readies = [i.ready for i in instances]
        await asyncio.wait(readies, timeout=self.start_timeout, return_when=asyncio.FIRST_EXCEPTION)
        for ready in readies:
            if ready.done() and not ready.cancelled() and (error := ready.exception()) is not None:
                raise error
        late = [i for i in instances if not i.ready.done()]
        if late:
            error = EngineError(
                f"instance process {late[0].index} of model {self.model!r} (pid {late[0].pid}) was not ready within "
                f"{self.start_timeout:g} s (instance_start_timeout)"
            )
            for instance in late:
                instance.ready.set_exception(error)  # its end, which follows, is no news
                if instance.process is not None:
                    instance.process.kill()  # stopped or stuck: it would ignore a SIGTERM
            raise error
        return [r.result() for r in readies]

    @property
    def starting(self) -> bool:
        """Whether a process is being restarted now, past any back-off (it takes batches once it is warm)."""
        return bool(self._starting)

    def backoff_left(self) -> float | None:
        """While no process is up and every one is waiting out its back-off: the seconds until the first starts again
        (None otherwise)."""
        if not self._due or self.starting or self.any_alive():
            return None
        return max(0.0, min(self._due.values()) - self._loop.time())

    def any_alive(self) -> bool:
        return any(i.alive for i in self.instances)

    def on_loop(self, call: Callable[..., object], *args: Any) -> None:
        """Run ``call(*args)`` on the event loop's thread: now where this is it, else at the loop's next turn (not at
        all once the loop is closed: the processes' sockets are gone with it)."""
        if threading.get_ident() == self._loop_thread:
            call(*args)
            return
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(call, *args)

    def lost(self, instance: P, was_ready: bool) -> None:
        """An instance process's socket closed: restart it at once unless the engine is closing (one that died while
        starting is :meth:`_respawn`'s to retry, with the backoff)."""
        if self.closing or not was_ready:
            return
        self.restarts += 1
        self._schedule_respawn(instance.index, 0.0, died=True)

    def _schedule_respawn(self, index: int, delay: float, died: bool = False) -> None:
        """Restart instance process ``index`` after ``delay`` seconds (``died``: it died serving, which is logged
        once it is reaped and its exit code known)."""
        if delay > 0:
            self._due[index] = self._loop.time() + delay
        else:
            self._starting.add(index)
        task = self._loop.create_task(self._respawn(index, delay, died))
        self._respawning.add(task)
        task.add_done_callback(self._respawning.discard)

    async def _respawn(self, index: int, delay: float, died: bool) -> None:
        try:
            await asyncio.sleep(delay)
        finally:
            self._due.pop(index, None)
        self._starting.add(index)
        try:
            await self._restart(index, died)
        finally:
            self._starting.discard(index)

    async def _restart(self, index: int, died: bool) -> None:
        if self.closing:
            return
        gone = self.instances[index]
        old, code = gone.process, None
        if old is not None:  # reaped and its pipes released now, not at a garbage collection
            with contextlib.suppress(ValueError):  # already closed
                what = f"instance process {index} of model {self.model}"
                code = await asyncio.to_thread(end, old, KILL_TIMEOUT_S, what)
        if died:
            # Logged once reaped: when its socket closes, a process may not have ended yet, nor have an exit code.
            log.error(
                "instance process %d of model %s (pid %s) %s; restarting it", index, self.model, gone.pid, ending(code)
            )
        try:
            instance = self._spawn(index)
            self.instances[index] = instance
            await self._ready([instance])
        except Exception as e:
            self._starting.discard(index)  # waiting out its back-off from now on
            self.last_failure = f"a restart failed: {e}"
            if not self.closing:
                self.start_failures += 1
                delay = RESPAWN_DELAYS_S[min(self.crashes, len(RESPAWN_DELAYS_S) - 1)]
                self.crashes += 1
                self._schedule_respawn(index, delay)
                log.error(
                    "instance process %d of model %s did not restart (%s); again in %.1fs", index, self.model, e, delay
                )
                if not self.any_alive():  # nothing else can take them meanwhile: sent again after the back-off
                    self._none_left(f"{self.last_failure}; the next start in {delay:g} s", math.ceil(delay))
            return
        if self.closing:
            instance.stop()
            return
        self.crashes = 0  # it started: the start-up backoff is over
        log.info("instance process %d of model %s restarted (pid %s)", index, self.model, instance.pid)
        self._restarted(instance)

    def close(self) -> None:
        """Stop restarting; tell every instance process to exit once its batch in hand is answered; kill one that does
        not in time.

        It waits for the processes (:data:`EXIT_TIMEOUT_S` at most, and then moments): call it off the event loop
        (``asyncio.to_thread``), where their answers and everything else go on meanwhile."""
        self.closing = True
        for task in list(self._respawning):
            self.on_loop(task.cancel)
        for instance in self.instances:
            self.on_loop(instance.stop)
        deadline = time.monotonic() + EXIT_TIMEOUT_S
        for instance in self.instances:
            process = instance.process
            if process is None or instance.pid is None:
                continue
            if not instance.alive:
                # Starting (or gone): no batch in hand to finish, and one stopped while it starts ignores a SIGTERM.
                with contextlib.suppress(ValueError):  # closed already
                    process.kill()
            end(process, max(0.0, deadline - time.monotonic()), f"instance process {instance.index} of {self.model}")
            instance.process = None  # closed: a second close passes it by


def _retrieve(ready: asyncio.Future[Any]) -> None:
    """Mark a start's failure as read: asyncio logs one never read, and a start given up on is not news."""
    if not ready.cancelled():
        ready.exception()
