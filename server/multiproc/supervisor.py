"""The front-end processes: spawned with the listening socket and the run's secret, restarted if one dies, stopped
on a drain."""

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

from server.multiproc import frontend
from server.settings import Settings

log = logging.getLogger(__name__)


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
        self.stopping = False
        self._context = multiprocessing.get_context("spawn")

    def start(self) -> None:
        for i in range(self.settings.http_workers):
            self._spawn(i)

    def _spawn(self, index: int) -> None:
        args = (self.settings, self.sock, self.api_socket, self.backplane_socket, self.secret, index)
        process = self._context.Process(target=frontend.run, args=args, name=f"halfserve-http-{index}", daemon=False)
        process.start()
        self.processes[index] = process

    async def watch(self) -> None:
        """Restart a front-end that exits while the server is not stopping."""
        while not self.stopping:
            await asyncio.sleep(0.5)
            for index, process in list(self.processes.items()):
                if not process.is_alive() and not self.stopping:
                    code = process.exitcode
                    log.error("front-end %d (pid %s) exited with %s; restarting it", index, process.pid, code)
                    self._spawn(index)

    def stop(self) -> None:
        """Tell every front-end to drain: it stops accepting, answers what it holds, and exits."""
        if self.stopping:
            return
        self.stopping = True
        for process in self.processes.values():
            if process.pid is not None and process.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signal.SIGTERM)

    async def join(self, timeout: float) -> None:
        """Wait up to ``timeout`` for the front-ends to exit, then kill what is left."""
        self.stop()
        deadline = time.monotonic() + timeout
        for process in self.processes.values():
            await asyncio.to_thread(process.join, max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                log.error("front-end (pid %s) did not drain in time; killing it", process.pid)
                process.kill()
                await asyncio.to_thread(process.join, 5.0)
        self.sock.close()
