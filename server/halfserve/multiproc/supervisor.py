"""The front-end processes: spawned with the listening socket, the run's secret and this process's pid (a front-end
exits once it has lost its connection to this process), restarted if one dies after it started, stopped on a drain;
one that dies before it started fails the whole server."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import multiprocessing.process
import os
import secrets
import signal
import socket
import time
from collections.abc import Callable

from halfserve.multiproc import frontend
from halfserve.settings import Settings

log = logging.getLogger(__name__)
EXIT_MARGIN_S = 1.0
"""A front-end's time to exit after its own drain timeout, counted from the signal sent here: at that timeout it ends
itself, abandoning the handler calls that still run (:meth:`halfserve.httpserver.DrainingServer.exit_past_drain`);
killed a moment earlier, its drain's last answers and log lines were lost."""


class Frontends:
    """The front-end processes: spawned with the listening socket, restarted if one dies, stopped on a drain."""

    def __init__(self, settings: Settings, sock: socket.socket, folder: str) -> None:
        self.settings = settings
        self.sock = sock
        self.api_socket = os.path.join(folder, "api.sock")
        self.backplane_socket = os.path.join(folder, "backplane.sock")
        self.secret = secrets.token_hex(32)
        """What a front-end's hello must carry: handed to each one as it is spawned (through multiprocessing's pipe,
        never its command line or environment), so no other process, the same user's included, can attach."""
        self.processes: dict[int, multiprocessing.process.BaseProcess] = {}
        self.connected: set[int] = set()
        """The pids of the front-ends that reached the engine process (said their hello): started."""
        self.failure: str | None = None
        """Why the server stops, when a front-end died before it started: restarting it would fail the same way."""
        self.on_failure: Callable[[], None] | None = None
        """Called once :attr:`failure` is set: stops the server (the engine process's HTTP server)."""
        self.stopping = False
        self._context = multiprocessing.get_context("spawn")

    def start(self) -> None:
        for i in range(self.settings.http_workers):
            self._spawn(i)

    def _spawn(self, index: int) -> None:
        args = (self.settings, self.sock, self.api_socket, self.backplane_socket, self.secret, index, os.getpid())
        process = self._context.Process(target=frontend.run, args=args, name=f"halfserve-http-{index}", daemon=False)
        process.start()
        self.processes[index] = process

    async def watch(self) -> None:
        """Restart a front-end that exits after it started, while the server is not stopping; stop the server when
        one exits before it started (a crash loop otherwise, and a server that never serves)."""
        while not self.stopping:
            await asyncio.sleep(0.5)
            for index, process in list(self.processes.items()):
                if process.is_alive() or self.stopping:
                    continue
                code = process.exitcode
                if process.pid not in self.connected:
                    self.failure = f"front-end {index} (pid {process.pid}) exited with {code} before it started"
                    log.error("%s; stopping the server", self.failure)
                    if self.on_failure is not None:
                        self.on_failure()
                    return
                log.error("front-end %d (pid %s) exited with %s; restarting it", index, process.pid, code)
                self.connected.discard(process.pid)
                process.close()  # its pipe and sentinel, now rather than when collected
                self._spawn(index)

    def stop(self) -> None:
        """Tell every front-end to drain: it stops accepting, answers what it holds, and exits.

        This process's copy of the listening socket is closed first (it only ever handed it to front-ends), so that
        the port refuses connections once the front-ends have closed theirs, as a single process's does. Held until
        they had exited, it kept listening through their drain with nobody accepting: each client whose connection a
        drain closed connected again, wrote its request into the backlog and lost it to a reset when the socket
        finally closed (a ``ReadError``, one per keep-alive client)."""
        if self.stopping:
            return
        self.stopping = True
        self.sock.close()
        for process in self.processes.values():
            if process.pid is not None and process.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signal.SIGTERM)

    async def join(self, timeout: float) -> None:
        """Wait up to ``timeout`` (and :data:`EXIT_MARGIN_S` more when it is not 0) for the front-ends to exit, then
        kill what is left."""
        self.stop()
        deadline = time.monotonic() + (timeout + EXIT_MARGIN_S if timeout else 0.0)
        for process in self.processes.values():
            await asyncio.to_thread(process.join, max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                log.error("front-end (pid %s) did not drain in time; killing it", process.pid)
                process.kill()
                await asyncio.to_thread(process.join, 5.0)
            if not process.is_alive():
                process.close()  # its pipe and sentinel, now rather than when collected
        self.sock.close()
