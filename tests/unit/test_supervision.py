"""The supervisor of a model's instance processes, with fake processes: a start bounded by the start timeout, and the
back-off after failed restarts, which the engine turns into a 503 with the time left."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from halfserve.engine.protocol import EngineError
from halfserve.isolated import supervision
from halfserve.isolated.supervision import Supervisor
from tests.waiting import until


class FakeProcess:
    """What the supervisor uses of a ``multiprocessing.Process``: it records being killed."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.exitcode: int | None = None
        self.exits_with: int | None = None
        """The exit code it has once joined (reaped); until then, None, as for a process whose end is not seen yet."""
        self.killed = False

    def kill(self) -> None:
        self.killed = True

    def terminate(self) -> None:
        self.killed = True

    def join(self, timeout: float | None = None) -> None:
        if self.exits_with is not None:
            self.exitcode = self.exits_with

    def is_alive(self) -> bool:
        return False

    def close(self) -> None:
        pass


class FakeInstance:
    """An instance process as its supervisor sees it: ready when the test says so, or never."""

    def __init__(self, index: int, pid: int) -> None:
        self.index = index
        self.process: Any = FakeProcess(pid)
        self.alive = False
        self.hung = False
        self.ready: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def stop(self) -> None:
        pass


class Spawner:
    """Spawns fake instances: each one ready at once, never ready, or failed at once, as :attr:`then` says."""

    def __init__(self) -> None:
        self.spawned: list[FakeInstance] = []
        self.then = "ready"

    def __call__(self, index: int) -> FakeInstance:
        instance = FakeInstance(index, 1000 + len(self.spawned))
        if self.then == "ready":
            instance.alive = True
            instance.ready.set_result({"index": index})
        elif self.then == "fail":
            instance.ready.set_exception(EngineError(f"instance process {index} (pid {instance.pid}) exited"))
        self.spawned.append(instance)
        return instance


def supervisor(spawn: Spawner, told: list[tuple[str, int]], start_timeout: float = 60.0) -> Supervisor[FakeInstance]:
    return Supervisor("m", spawn, lambda _: None, lambda why, after: told.append((why, after)), start_timeout)


async def test_a_process_not_ready_within_the_start_timeout_is_killed_and_its_start_fails() -> None:
    spawn = Spawner()
    spawn.then = "never"  # stopped, or stuck in its warm-up: it never says it is ready
    with pytest.raises(EngineError) as raised:
        await supervisor(spawn, [], start_timeout=0.01).start(2)
    assert str(raised.value) == "instance process 0 of model 'm' (pid 1000) was not ready within 0.01 s " + (
        "(instance_start_timeout)"
    )
    assert [i.process.killed for i in spawn.spawned] == [True, True]


async def test_a_start_fails_with_the_error_of_the_process_that_did_not_start() -> None:
    spawn = Spawner()
    spawn.then = "fail"
    with pytest.raises(EngineError, match=r"instance process 0 \(pid 1000\) exited"):
        await supervisor(spawn, []).start(1)


async def test_while_every_process_waits_out_its_back_off_the_time_left_is_told(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(supervision, "RESPAWN_DELAYS_S", (600.0,))  # far longer than the test
    spawn, told = Spawner(), []
    watched = supervisor(spawn, told)
    await watched.start(1)
    assert watched.backoff_left() is None
    spawn.then = "fail"
    first = spawn.spawned[0]
    first.alive = False
    watched.lost(first, was_ready=True)  # it died serving: restarted at once, and that restart dies while starting
    assert watched.starting
    assert watched.backoff_left() is None  # starting: a batch waits for it

    await until(lambda: told, "the back-off told")  # once the dead process is reaped, in a worker thread
    [(why, after)] = told  # the batches waiting for the restart are told to come back after the back-off
    assert why == "a restart failed: instance process 0 (pid 1001) exited; the next start in 600 s"
    assert after == 600
    assert not watched.starting
    left = watched.backoff_left()
    assert left is not None
    assert 0 < left <= 600
    assert watched.last_failure == "a restart failed: instance process 0 (pid 1001) exited"
    assert (watched.start_failures, watched.restarts) == (1, 1)
    watched.close()
    await asyncio.sleep(0)
    assert not watched.starting


async def test_no_back_off_is_told_while_another_process_serves(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(supervision, "RESPAWN_DELAYS_S", (600.0,))
    spawn, told = Spawner(), []
    watched = supervisor(spawn, told)
    await watched.start(2)
    spawn.then = "fail"
    first = spawn.spawned[0]
    first.alive = False
    watched.lost(first, was_ready=True)
    # The restart fails once the dead process is reaped, in a worker thread: however long that thread takes to run.
    await until(lambda: watched.start_failures == 1, "the restart failed")
    assert told == []  # the other process takes the batches meanwhile
    assert watched.backoff_left() is None
    watched.close()


@pytest.mark.parametrize(("code", "said"), [(-9, "was killed by SIGKILL"), (3, "exited with code 3")])
async def test_a_process_that_dies_serving_is_logged_with_how_it_ended_once_reaped(
    code: int, said: str, caplog: pytest.LogCaptureFixture
) -> None:
    spawn = Spawner()
    watching = supervisor(spawn, [])
    await watching.start(1)
    [instance] = spawn.spawned
    instance.process.exits_with = code  # its socket closed before its exit code could be read (had logged "None")
    instance.alive = False
    with caplog.at_level(logging.ERROR, logger="halfserve.isolated.supervision"):
        watching.lost(instance, was_ready=True)
        await until(lambda: len(spawn.spawned) == 2, "the process restarted")
    assert f"instance process 0 of model m (pid 1000) {said}; restarting it" in caplog.messages
