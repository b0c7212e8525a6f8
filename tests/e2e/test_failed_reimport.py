"""A server serving v1 of a text model through a re-import that fails (no tokenizer), one killed while it writes, a
version left half written, reloads and loads of the newest version, and a restart: v1 answers throughout, ``/ready``
stays 200, and ``/models`` names the version that failed and why."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from halfserve import storage, store
from tests.conftest import StartServer
from tests.waiting import DEADLINE_S

pytest.importorskip("transformers")
from tests.integration.test_padding_invariance import import_args, text_bert  # noqa: E402

TOKEN = "reimport-admin-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
TEXT = ["--mask", "attention_mask", "--text", "text"]
MAX_REQUESTS = 5000
"""A bound on the traffic sent while the store changes (it stops before, once the steps are done)."""


def halfserve_import(source: Path, root: Path) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "halfserve", *import_args(source, root, *TEXT)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


class Traffic:
    """Requests to the model and readiness probes in a thread, each status kept, until stopped."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.statuses: list[tuple[str, int, str]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=DEADLINE_S) as client:
            while not self.stop.is_set() and len(self.statuses) < MAX_REQUESTS:
                r = client.post("/predict", json={"model": "bert", "inputs": ["a short review"]})
                self.statuses.append(("predict", r.status_code, r.text[:200]))
                r = client.get("/ready")
                self.statuses.append(("ready", r.status_code, r.text[:200]))
                time.sleep(0.01)

    def __enter__(self) -> Traffic:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=DEADLINE_S)


def served(url: str) -> dict[str, object]:
    entries = httpx.get(f"{url}/models").json()["models"]
    entry: dict[str, object] = next(m for m in entries if m["name"] == "bert")
    return entry


@pytest.mark.slow
def test_v1_answers_through_failed_and_killed_reimports_and_reloads(
    server_factory: StartServer, tmp_path: Path
) -> None:
    source, root = text_bert(tmp_path / "bert"), tmp_path / "store"
    done = halfserve_import(source, root)
    _, err = done.communicate(timeout=300)
    assert done.returncode == 0, err
    server = server_factory(root, "--admin-token", TOKEN)
    model_dir = root / "bert"
    with Traffic(server.url) as traffic:
        # A re-import from a folder without its tokenizer: refused, nothing written.
        untokenized = tmp_path / "untokenized"
        shutil.copytree(source, untokenized)
        (untokenized / "tokenizer.json").unlink()
        failed = halfserve_import(untokenized, root)
        _, err = failed.communicate(timeout=300)
        assert failed.returncode == 2, err
        assert "tokenizer.json: not found" in err
        assert sorted(p.name for p in model_dir.iterdir()) == ["1", storage.MANIFEST]

        # A re-import killed while it writes: whenever the kill lands, no version is half there.
        killed = halfserve_import(source, root)
        deadline = time.monotonic() + 300
        while killed.poll() is None and not any(model_dir.glob(".import-*")):
            assert time.monotonic() < deadline, "the import wrote no folder"
            time.sleep(0.005)
        killed.send_signal(signal.SIGKILL)
        killed.communicate(timeout=DEADLINE_S)
        for version in storage.versions(model_dir):
            assert store.load(root, "bert", version).version == version
        # What a kill before the rename leaves, whatever happened above: ignored by the server.
        leftover = model_dir / ".import-999999999-half"
        leftover.mkdir()
        shutil.copyfile(source / "config.json", leftover / "config.json")
        (leftover / storage.WEIGHTS).write_bytes(b"half a checkpo")
        r = httpx.post(f"{server.url}/models/bert/reload", json={}, headers=AUTH, timeout=DEADLINE_S)
        assert r.status_code == 200, r.text
        assert r.json()["version"] == 1

        # A version left half written (as imports did before they were atomic): a load of the newest fails, named,
        # and v1 goes on serving.
        broken = max(storage.versions(model_dir)) + 1
        (model_dir / str(broken)).mkdir()
        for file in ("config.json", storage.WEIGHTS):
            shutil.copyfile(source / file, model_dir / str(broken) / file)
        for path in ("/models/bert/load", "/v2/repository/models/bert/load"):
            r = httpx.post(f"{server.url}{path}", json={}, headers=AUTH, timeout=DEADLINE_S)
            assert r.status_code == 400, r.text
            assert f"{broken}/tokenizer.json" in r.json()["error"]
        r = httpx.post(f"{server.url}/models/bert/reload", json={}, headers=AUTH, timeout=DEADLINE_S)
        assert r.status_code == 200, r.text
        entry = served(server.url)
        time.sleep(0.2)  # a few more requests after the last reload
    assert (entry["version"], entry["state"]) == (1, "ready")
    failures = entry["failed_versions"]
    assert isinstance(failures, list)
    assert [f["version"] for f in failures] == [broken]
    assert "tokenizer.json" in failures[0]["error"]
    refused = [s for s in traffic.statuses if s[1] != 200]
    assert refused == []
    assert sum(1 for s in traffic.statuses if s[0] == "predict") > 0

    # Restarted on that store, the server serves the newest version that loads and says which it passed over.
    server.stop()
    again = server_factory(root, "--admin-token", TOKEN)
    entry = served(again.url)
    assert entry["state"] == "ready"
    assert entry["version"] == broken - 1
    assert [f["version"] for f in entry["failed_versions"]] == [broken]  # type: ignore[union-attr]
    assert httpx.get(f"{again.url}/ready").status_code == 200
    log = again.log.read_text()
    assert f"model bert v{broken} failed to load" in log
    assert f"model bert serves v{broken - 1}, its newest version that loads" in log
