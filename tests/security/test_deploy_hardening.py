"""The deployment files run the server with the least it needs: a read-only root file system with one writable
``/tmp``, no capabilities, no service account token, the runtime's seccomp profile, a non-root user and group. And the
server really runs that way: under a read-only root with only its temp dir writable, ``--http-workers`` included."""

from __future__ import annotations

import os
import re
import shutil
import signal
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import ServerProcess, save_tiny_mlp, start_server
from tests.unit.test_deploy_manifests import (
    COMPOSE,
    DEPLOYMENT,
    DOCKERFILE,
    INFERENCE_SERVICE,
    Dockerfile,
    load_yaml,
)

TMP = "/tmp"


def pod_and_container(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    obj = load_yaml(path)
    pod = obj["spec"]["predictor"] if obj["kind"] == "InferenceService" else obj["spec"]["template"]["spec"]
    [container] = pod["containers"]
    return pod, container


@pytest.mark.parametrize("path", [DEPLOYMENT, INFERENCE_SERVICE], ids=lambda p: p.name)
def test_pods_run_read_only_without_token_or_capabilities(path: Path) -> None:
    pod, container = pod_and_container(path)
    assert pod["automountServiceAccountToken"] is False
    security = {**pod.get("securityContext", {}), **container["securityContext"]}
    assert security["readOnlyRootFilesystem"] is True
    assert security["runAsNonRoot"] is True
    assert security["runAsUser"] == security["runAsGroup"] == 10001
    assert security["seccompProfile"] == {"type": "RuntimeDefault"}
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"] == {"drop": ["ALL"]}
    # /tmp is writable: an emptyDir of bounded size.
    [mount] = [m for m in container["volumeMounts"] if m["mountPath"] == TMP]
    [volume] = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    assert "sizeLimit" in volume["emptyDir"]


def test_compose_runs_read_only_without_capabilities() -> None:
    service = load_yaml(COMPOSE)["services"]["halfserve"]
    assert service["read_only"] is True
    assert service["cap_drop"] == ["ALL"]
    assert any(t.split(":")[0] == TMP for t in service["tmpfs"])
    assert "no-new-privileges:true" in service["security_opt"]


def test_the_image_keeps_every_cache_under_tmp() -> None:
    env = Dockerfile.parse().env
    for name in ("TMPDIR", "XDG_CACHE_HOME", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "CUDA_CACHE_PATH"):
        assert env[name] == TMP or env[name].startswith(TMP + "/"), name


READ_ONLY_ROOT = (
    'mount --make-rprivate / && mount -t tmpfs -o size=64m tmpfs "$WRITABLE" && mount -o remount,bind,ro / '
    '&& exec env TMPDIR="$WRITABLE" HOME=/nonexistent "$@"'
)


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root and unshare(1)")
def test_the_server_runs_on_a_read_only_root_with_only_its_temp_dir_writable(tmp_path: Path) -> None:
    store, writable = tmp_path / "store", tmp_path / "tmp"
    writable.mkdir()
    save_tiny_mlp(store)
    wrapper = ["unshare", "--mount", "sh", "-c", READ_ONLY_ROOT, "sh"]
    server: ServerProcess = start_server(
        store, tmp_path / "server.log", "--http-workers", "2", env={"WRITABLE": str(writable)}, wrapper=wrapper
    )
    try:
        mounts = Path(f"/proc/{server.proc.pid}/mountinfo").read_text().splitlines()
        root = next(line.split() for line in mounts if line.split()[4] == "/")
        assert "ro" in root[5].split(","), root  # the server's own view of /
        r = httpx.post(f"{server.url}/predict", json={"inputs": [[0.5] * 16]}, timeout=30)
        assert r.status_code == 200, r.text
        assert httpx.get(f"{server.url}/ready", timeout=10).status_code == 200
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=30) == 0
    finally:
        server.stop()
    log = server.log.read_text()
    assert "Read-only file system" not in log, log
    assert "Traceback" not in log, log


def test_every_base_image_is_named_by_digest() -> None:
    text = DOCKERFILE.read_text()
    args = dict(re.findall(r"^ARG (\w+)=(\S+)$", text, re.MULTILINE))
    froms = re.findall(r"^FROM (\S+)", text, re.MULTILINE)
    assert froms
    for image in froms:
        resolved = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], image)
        if resolved in re.findall(r"^FROM \S+ AS (\S+)", text, re.MULTILINE):
            continue  # an earlier stage of this file
        assert re.search(r"@sha256:[0-9a-f]{64}$", resolved), f"FROM {image} ({resolved}) is not pinned by digest"
    assert not text.startswith("# syntax="), "a frontend image pulled by its tag at build time"
