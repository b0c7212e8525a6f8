"""What the container runs, run here on the CPU: the Dockerfile's own command and ``HALFSERVE_*`` environment.

No Docker engine is needed: the command comes from the Dockerfile's ENTRYPOINT and CMD, the configuration from its
ENV lines, with the address, port, store and device changed for this machine, and where the machine allows it the
process is PID 1 of a PID namespace of its own, as in a container. The server must become ready, pass the image's
and compose's health checks as written, and exit 0 on SIGTERM within compose's stop_grace_period.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import SHIPPED_STORE, free_port
from tests.unit.test_deploy_manifests import COMPOSE, ROOT, Dockerfile, duration_s, load_yaml

pytestmark = pytest.mark.slow


def executable(name: str) -> str:
    """``name`` as installed beside this interpreter (the image puts its venv first on PATH the same way)."""
    if name == "python":
        return sys.executable
    found = shutil.which(name, path=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    assert found, f"{name} is not installed (pip install -e .)"
    return found


def image_env(dockerfile: Dockerfile, port: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HALFSERVE_")}
    # The console script must import this checkout's package (server/halfserve/), whatever else is installed.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "server"), env.get("PYTHONPATH")]))
    env.update({k: v for k, v in dockerfile.env.items() if k.startswith("HALFSERVE_")})
    env.update(
        HALFSERVE_HOST="127.0.0.1",
        HALFSERVE_PORT=str(port),
        HALFSERVE_STORE=str(SHIPPED_STORE),
        HALFSERVE_DEVICE="cpu",
    )
    return env


def as_pid1() -> list[str]:
    """A prefix that runs a command as PID 1 of a new PID namespace, like a container's entrypoint; [] where the
    machine allows no namespace."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return []
    for flags in (
        ["--pid", "--fork", "--kill-child"],
        ["--user", "--map-root-user", "--pid", "--fork", "--kill-child"],
    ):
        if subprocess.run([unshare, *flags, "true"], capture_output=True, timeout=10).returncode == 0:
            return [unshare, *flags]
    return []


def child_pid(pid: int, timeout_s: float = 10) -> int:
    """The process ``unshare --fork`` started (signals to unshare itself are not passed on)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        if children:
            return int(children[0])
        time.sleep(0.01)
    raise AssertionError("unshare started no child")


def run_check(argv: list[str], env: dict[str, str]) -> int:
    return subprocess.run([executable(argv[0]), *argv[1:]], env=env, capture_output=True, timeout=30).returncode


def wait_ready(url: str, proc: subprocess.Popen[bytes], log: Path, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited with {proc.returncode}:\n{log.read_text()}")
        try:
            if httpx.get(f"{url}/ready", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"server not ready within {timeout_s} s:\n{log.read_text()}")


def test_the_images_command_serves_passes_its_health_checks_and_drains_on_sigterm(tmp_path: Path) -> None:
    dockerfile = Dockerfile.parse()
    compose = load_yaml(COMPOSE)["services"]["halfserve"]
    grace_s = duration_s(compose["stop_grace_period"])
    assert dockerfile.one("STOPSIGNAL") == compose["stop_signal"] == "SIGTERM"
    port = free_port()
    env = image_env(dockerfile, port)
    url = f"http://127.0.0.1:{port}"
    checks = {
        "Dockerfile HEALTHCHECK": dockerfile.healthcheck,
        "compose healthcheck": compose["healthcheck"]["test"][1:],
    }

    # Nothing listens yet: the checks must fail, or they would pass a dead container.
    for where, argv in checks.items():
        assert run_check(argv, env) != 0, f"{where} passes with no server"

    command = dockerfile.command
    prefix = as_pid1()
    log = tmp_path / "server.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [*prefix, executable(command[0]), *command[1:]], env=env, stdout=out, stderr=subprocess.STDOUT
        )
    try:
        wait_ready(url, proc, log)
        assert httpx.get(f"{url}/health").status_code == 200
        for where, argv in checks.items():
            assert run_check(argv, env) == 0, f"{where} fails against a ready server"
        models = httpx.get(f"{url}/models").json()["models"]
        assert {m["name"] for m in models} == {p.parent.name for p in SHIPPED_STORE.glob("*/config.json")}
        assert all(m["device"] == "cpu" for m in models)

        os.kill(child_pid(proc.pid) if prefix else proc.pid, signal.SIGTERM)
        try:
            code = proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running {grace_s} s after SIGTERM: docker would SIGKILL it\n{log.read_text()}")
        assert "Application shutdown complete" in log.read_text(), log.read_text()
        assert code == 0, f"exit status {code}\n{log.read_text()}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
