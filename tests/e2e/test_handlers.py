"""A team's own pre- and post-processing code (the manifest's ``handler`` section, issue 51) on a real server: a
handler module written to a ``--code-path`` folder parses CSV bodies into digits_cnn's 64 pixels and answers
``{"digit": ..., "confidence": ...}``; a raw body, ``curl -T`` and a form of several files answered in order with
the digits the same rows get as tensors; a handler module shipped in the model folder is refused at import and at
load, where that model fails with the reason while the others serve."""

from __future__ import annotations

import asyncio
import base64
import json
import shutil
import signal
import subprocess
import textwrap
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from sklearn.datasets import load_digits

from halfserve import cli, handlers, storage
from halfserve.handlerinput import HandlerSection
from halfserve.manifest import load_manifest
from halfserve.settings import Settings
from tests.conftest import DIGITS_CNN_IMPORT, ServerProcess, StartServer
from tests.security.test_model_code import started
from tests.waiting import DEADLINE_S

pytestmark = pytest.mark.slow

MODEL = "digits_csv"
TIMEOUT = httpx.Timeout(120.0)
ROWS = 12

HANDLER_CODE = textwrap.dedent(
    '''
    """A TorchServe-style handler: CSV bodies of 64 values (0..16) in, a digit and its probability out."""
    import time

    import numpy as np


    class Digits:
        def preprocess(self, requests):
            rows = []
            for request in requests:
                data = request.get("data") or request.get("body")
                rows.append([float(v) / 16 for v in data.decode().split(",")])
            return np.asarray(rows, dtype=np.float32).reshape(len(rows), 1, 8, 8)

        def postprocess(self, outputs, requests):
            answers = []
            for row in outputs:
                e = np.exp(row - row.max())
                p = e / e.sum()
                answers.append({"digit": int(p.argmax()), "confidence": float(p.max())})
            return answers


    class Raises(Digits):
        def preprocess(self, requests):
            raise ValueError("row 1: 'x' is not a number\\n  <Digits object at 0x7f3a2b1c0d90>")


    class PostRaises(Digits):
        def postprocess(self, outputs, requests):
            return {}["label"]


    class WrongShape(Digits):
        def preprocess(self, requests):
            return np.zeros((len(requests), 64), dtype=np.float32)


    class WrongRows(Digits):
        def preprocess(self, requests):
            return np.zeros((len(requests) + 1, 1, 8, 8), dtype=np.float32)


    class WrongDtype(Digits):
        def preprocess(self, requests):
            return np.zeros((len(requests), 1, 8, 8), dtype=np.complex64)


    class TooFewAnswers(Digits):
        def postprocess(self, outputs, requests):
            return super().postprocess(outputs, requests)[:-1]


    class NotJson(Digits):
        def postprocess(self, outputs, requests):
            return [object() for _ in requests]


    class Slow(Digits):
        def preprocess(self, requests):
            time.sleep(3)
            return super().preprocess(requests)


    class Hangs(Digits):
        def preprocess(self, requests):
            time.sleep(3600)
    '''
)
"""The handlers of the tests: ``Digits`` right, each other one wrong in one way (tests/security)."""
MODULE = "digits_handlers"
HUNG = "hangs"
"""A model whose handler's preprocess never returns in a test's time."""


def csv(row: np.ndarray) -> bytes:
    return ",".join(str(int(v)) for v in row).encode()


def b64(row: np.ndarray) -> str:
    """A row's CSV as a KServe V1 instance's ``data`` carries bytes."""
    return base64.b64encode(csv(row)).decode()


def digits_rows() -> np.ndarray:
    return load_digits().data[:ROWS]


def with_handler(root: Path, name: str, code: str, **section: object) -> None:
    """A copy of ``MODEL``'s folder as ``name``, its manifest naming ``code`` as its handler."""
    shutil.copytree(root / MODEL, root / name)
    manifest_file = root / name / storage.MANIFEST
    manifest = json.loads(manifest_file.read_text())
    manifest["name"] = name
    manifest["handler"] = {"code": code, **section}
    manifest_file.write_text(json.dumps(manifest))


def build_store(root: Path, code: Path) -> None:
    """``MODULE`` in the ``code`` folder, and digits_cnn's weights imported as ``MODEL`` with ``--handler``."""
    code.mkdir(exist_ok=True)
    (code / f"{MODULE}.py").write_text(HANDLER_CODE)
    rest = ["--samples", "8", "--store", str(root), "--code-path", str(code)]
    assert cli.main([*DIGITS_CNN_IMPORT, "--name", MODEL, "--handler", f"{MODULE}:Digits", *rest]) == 0
    assert load_manifest(root / MODEL).handler == HandlerSection(code=f"{MODULE}:Digits")


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The store, with ``shipped``: a model whose handler module lies in its own model folder only."""
    root = tmp_path_factory.mktemp("handler-store")
    code = root.parent / "handler-code"
    build_store(root, code)
    with_handler(root, "shipped", "shipped_handler:Digits")
    with_handler(root, HUNG, f"{MODULE}:Hangs", timeout_s=1)
    (root / "shipped" / "shipped_handler.py").write_text(HANDLER_CODE)
    return root, code


@pytest.fixture(scope="module")
def server(server_factory: StartServer, store: tuple[Path, Path]) -> ServerProcess:
    root, code = store
    return server_factory(root, "--code-path", str(code), "--models", MODEL)


def tensor_digits(url: str, rows: np.ndarray) -> list[int]:
    values = (rows.astype(np.float32) / 16).reshape(-1, 1, 8, 8).tolist()
    r = httpx.post(f"{url}/predict", json={"model": MODEL, "inputs": values}, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    return [int(np.argmax(p)) for p in r.json()["outputs"]]


def test_a_raw_body_is_answered_by_the_handler(server: ServerProcess) -> None:
    rows = digits_rows()
    expected = tensor_digits(server.url, rows)
    for i, row in enumerate(rows[:4]):
        r = httpx.put(f"{server.url}/predictions/{MODEL}", content=csv(row), timeout=TIMEOUT)  # curl -T
        assert r.status_code == 200, r.text
        answer = r.json()
        assert answer["digit"] == expected[i]
        assert 0.1 < answer["confidence"] <= 1.0
    r = httpx.post(f"{server.url}/predictions/{MODEL}/1", content=csv(rows[0]), timeout=TIMEOUT)
    assert r.status_code == 200
    assert r.json()["digit"] == expected[0]


def test_several_files_in_a_form_are_answered_in_order(server: ServerProcess) -> None:
    rows = digits_rows()
    expected = tensor_digits(server.url, rows)
    files = [("data", (f"row{i}.csv", csv(row), "text/csv")) for i, row in enumerate(rows)]
    r = httpx.post(f"{server.url}/predictions/{MODEL}", files=files, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    answers = r.json()
    assert [a["digit"] for a in answers] == expected
    assert len(set(expected)) > 3  # the rows differ, so an order lost would show


def test_kserve_v1_instances_are_answered_by_the_handler_in_instance_processes(
    server_factory: StartServer, store: tuple[Path, Path]
) -> None:
    """KServe's TorchServe predictor's ``{"instances": [{"data": "<base64>"}]}``, over the wire to a server whose
    handler runs in the model's instance processes: one prediction per instance, in order, as the form's answers."""
    root, code = store
    processes = server_factory(root, "--code-path", str(code), "--models", MODEL, "--placement", "instance_processes")
    rows = digits_rows()
    expected = tensor_digits(processes.url, rows)
    instances = [{"data": b64(row)} for row in rows]
    r = httpx.post(f"{processes.url}/v1/models/{MODEL}:predict", json={"instances": instances}, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    assert [a["digit"] for a in r.json()["predictions"]] == expected
    assert len(set(expected)) > 3  # the rows differ, so an order lost would show
    bad = httpx.post(
        f"{processes.url}/v1/models/{MODEL}:predict", json={"instances": [{"data": "1,2"}]}, timeout=TIMEOUT
    )
    assert (bad.status_code, bad.json()) == (
        400,
        {"error": "instances[0].data: not base64 (standard alphabet, padded)"},
    )


async def failed(client: httpx.AsyncClient, name: str) -> None:
    """Return once model ``name``'s load has failed: it may load after the model ``started`` waited for, and until
    then a request finds it loading, not failed."""
    deadline = time.monotonic() + DEADLINE_S
    while (await client.get(f"/models/{name}")).json()["state"] != "failed":
        assert time.monotonic() < deadline, f"model {name!r} did not fail its load"
        await asyncio.sleep(0.05)


async def test_a_handler_in_the_model_folder_fails_its_model_at_load_and_runs_nothing(
    store: tuple[Path, Path], tmp_path: Path
) -> None:
    root, code = store
    marker = tmp_path / "ran"
    (root / "shipped" / "shipped_handler.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n" + HANDLER_CODE)
    async with started(Settings(store=root, code_path=[code]), MODEL) as client:
        ok = await client.put(f"/predictions/{MODEL}", content=csv(digits_rows()[0]))
        assert ok.status_code == 200, ok.text
        await failed(client, "shipped")
        refused = await client.put("/predictions/shipped", content=csv(digits_rows()[0]))
        assert refused.status_code == 503, refused.text  # TorchServe's answer for a model without a worker
        assert refused.json()["message"].startswith("model 'shipped' is failed: handler 'shipped_handler:Digits': ")
        listed = (await client.get("/models")).text
    assert "shipped_handler" in listed
    assert "--code-path" in listed
    assert not marker.exists()


async def test_a_model_whose_handler_failed_to_build_is_answered_at_once_without_building_it_again(
    store: tuple[Path, Path], tmp_path: Path
) -> None:
    """A handler whose build raised failed its model at load; each request to ``/predictions`` had built it again (the
    team's ``__init__`` run per request, a request waiting out a build that hangs) to answer a 404, past its body. Now
    the model's state is the answer, before the body: 503 ``is failed``, with the load's error, as V1 and /predict."""
    root, code = store
    builds = tmp_path / "builds"
    record = f"        with open({str(builds)!r}, 'a') as f:\n            f.write('built\\n')\n"
    failing = HANDLER_CODE.replace(
        "class Digits:",
        f"class Digits:\n    def __init__(self):\n{record}        raise RuntimeError('no labels file')\n",
        1,
    )
    (code / "failing_handler.py").write_text(failing)
    with_handler(root, "failing", "failing_handler:Digits")
    try:
        async with started(Settings(store=root, code_path=[code]), MODEL) as client:
            await failed(client, "failing")
            assert builds.read_text() == "built\n"  # the load's build, which failed it
            answers = [
                await client.put("/predictions/failing", content=body) for body in (csv(digits_rows()[0]), b"", b"x,y")
            ]
    finally:
        shutil.rmtree(root / "failing")
    for r in answers:
        assert r.status_code == 503, r.text
        assert r.json()["message"].startswith("model 'failing' is failed: handler 'failing_handler:Digits': ")
        assert "no labels file" in r.json()["message"]
    assert builds.read_text() == "built\n"  # not built again by a request


def test_a_handler_in_the_model_folder_is_refused_at_import(
    store: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root, _ = store
    folder = tmp_path / "model-folder"
    folder.mkdir()
    (folder / "folder_handler.py").write_text(HANDLER_CODE)
    weights = Path(DIGITS_CNN_IMPORT[1])
    shutil.copy(weights, folder / weights.name)
    argv = [*DIGITS_CNN_IMPORT, "--name", "refused", "--handler", "folder_handler:Digits", "--store", str(tmp_path)]
    argv[1] = str(folder / weights.name)
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "--handler: handler 'folder_handler:Digits'" in err
    assert "--code-path" in err
    assert not (tmp_path / "refused").exists()


def test_an_import_whose_handler_build_hangs_is_refused_at_the_build_limit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A handler whose build hangs (an initialize that waits on a resource) had held ``halfserve import`` for ever, as
    serving it fails the load at the limit: the import is refused at the same limit, naming the handler, and writes
    nothing."""
    code = tmp_path / "code"
    code.mkdir()
    hanging = HANDLER_CODE.replace(
        "class Digits:", "class Digits:\n    def __init__(self):\n        time.sleep(30)\n", 1
    )
    (code / "hanging_handler.py").write_text(hanging)
    monkeypatch.setattr(handlers, "BUILD_TIMEOUT_S", 0.5)
    rest = ["--store", str(tmp_path / "store"), "--code-path", str(code), "--samples", "8"]
    argv = [*DIGITS_CNN_IMPORT, "--name", "hangs", "--handler", "hanging_handler:Digits", *rest]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "--handler: handler 'hanging_handler:Digits': building it (its initialize) ran past 0.5 s" in err
    assert not (tmp_path / "store" / "hangs").exists()


def test_front_end_processes_answer_through_the_handler_too(
    server_factory: StartServer, store: tuple[Path, Path]
) -> None:
    root, code = store
    workers = server_factory(root, "--code-path", str(code), "--models", MODEL, "--http-workers", "2")
    rows = digits_rows()
    expected = tensor_digits(workers.url, rows)
    for i, row in enumerate(rows[:6]):  # new connections: both front-ends answer some
        with httpx.Client(timeout=TIMEOUT) as client:
            r = client.put(f"{workers.url}/predictions/{MODEL}", content=csv(row))
            v1 = client.post(f"{workers.url}/v1/models/{MODEL}:predict", json={"instances": [{"data": b64(row)}]})
        assert r.status_code == 200, r.text
        assert r.json()["digit"] == expected[i]
        assert v1.status_code == 200, v1.text
        assert v1.json()["predictions"][0]["digit"] == expected[i]


@pytest.mark.parametrize("workers", [[], ["--http-workers", "2"]], ids=["one-process", "front-ends"])
def test_a_handler_call_that_hangs_does_not_hold_the_exit_past_the_drain_timeout(
    server_factory: StartServer, store: tuple[Path, Path], workers: list[str]
) -> None:
    root, code = store
    server = server_factory(root, "--code-path", str(code), "--models", HUNG, "--drain-timeout", "2", *workers)
    r = httpx.put(f"{server.url}/predictions/{HUNG}", content=csv(digits_rows()[0]), timeout=TIMEOUT)
    assert r.status_code == 504, r.text
    server.proc.send_signal(signal.SIGTERM)
    try:  # a bound on a hang (the call sleeps an hour), not a measurement
        code_at_exit = server.proc.wait(timeout=DEADLINE_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the server did not exit after SIGTERM:\n{server.log.read_text()}")
    log = server.log.read_text()
    assert code_at_exit == 0, log
    assert f"model {HUNG} drained:" in log
    assert f"handler calls still running past the drain timeout are abandoned (model '{HUNG}': 1)" in log
    assert "did not drain in time" not in log  # front-ends: each ended itself, none was killed
