"""A team's handler where the model's instances are processes (issue 51): each handler batch goes to an instance
process as its raw payloads, and ``preprocess``, the forward and ``postprocess`` run there (the handler's answers
carry the pid that ran them: not this one's), concurrent requests still make one batch, and one bad payload among
good ones fails alone (the batch is rerun one request per call, in the instance process too)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import textwrap
from pathlib import Path

import httpx
import numpy as np
import pytest

from halfserve import storage
from halfserve.settings import Settings
from tests.e2e.test_handlers import HANDLER_CODE, b64, build_store, csv, digits_rows, with_handler
from tests.security.test_model_code import started
from tests.waiting import DEADLINE_S

pytestmark = pytest.mark.slow

NAME = "digits_in_instance"
MODULE = "digits_instance_handlers"
"""The handler's module: a name of its own, as a module once imported stays so for the whole process."""
MAX_BATCH = 4
"""As many payloads as a test sends at once: the batch is cut when they are all queued, never by the delay."""

TIMEOUT_S = 1.0
"""The handler's time limit: a payload ``slow`` sleeps past it."""

CODE = HANDLER_CODE + textwrap.dedent(
    """

    import os
    import pathlib
    import threading


    class Where(Digits):
        def preprocess(self, requests):
            bodies = [r.get("data") or r.get("body") for r in requests]
            if b"exit" in bodies:
                os._exit(1)  # the process dies, as a crash in a native decoder would take it
            if any(b.startswith(b"slow") for b in bodies):
                time.sleep(3)
            if b"rows" in bodies:
                return np.zeros((len(requests) + 1, 1, 8, 8), dtype=np.float32)
            return super().preprocess(requests)

        def postprocess(self, outputs, requests):
            answers = super().postprocess(outputs, requests)
            return [{**a, "pid": os.getpid(), "batch": len(requests)} for a in answers]


    # TorchServe's contract, reading a payload as TorchServe's text handlers do: a text as it is, bytes decoded.
    class TextDigits:

        def initialize(self, context):
            self.given = []

        def preprocess(self, data):
            rows, self.given = [], []
            for row in data:
                text = row.get("data") or row.get("body")
                self.given.append(type(text).__name__)
                if isinstance(text, (bytes, bytearray)):
                    text = text.decode()
                rows.append([float(v) / 16 for v in text.split(",")])
            return np.asarray(rows, dtype=np.float32).reshape(len(rows), 1, 8, 8)

        def postprocess(self, data):
            digits = data.argmax(1).tolist()
            return [{"digit": d, "given": g, "pid": os.getpid()} for d, g in zip(digits, self.given, strict=True)]


    # TorchServe's contract, keeping its batch's state on self from preprocess to postprocess as TorchServe's handlers
    # do. A payload "hold <file>" waits for <file> to exist before it keeps its tag; another payload whose preprocess
    # runs while a held one does creates that file, and its postprocess waits for the held call to end: only calls
    # run side by side on the handler then answer with another request's tag.
    class KeepsTag:

        def initialize(self, context):
            self.tag, self.release, self.idle = "", None, threading.Event()
            self.idle.set()

        def preprocess(self, data):
            text = data[0].get("data") or data[0].get("body")
            text = text.decode() if isinstance(text, (bytes, bytearray)) else text
            if text.startswith("hold "):
                self.idle.clear()
                self.release = pathlib.Path(text[len("hold "):])
                waited = time.monotonic() + 60
                while not self.release.exists() and time.monotonic() < waited:
                    time.sleep(0.01)
                self.tag, self.release = text, None
                self.idle.set()
            else:
                self.tag, held = text, self.release
                if held is not None:
                    held.touch()
            return np.zeros((len(data), 1, 8, 8), dtype=np.float32)

        def postprocess(self, data):
            self.idle.wait(60)
            return [{"tag": self.tag} for _ in data]
    """
)
TEXT_NAME = "digits_text"
"""A model answered by ``TextDigits``, a ``torchserve``-style handler (made by the test that serves it)."""
KEEPS_NAME = "digits_keeps"
"""A model answered by ``KeepsTag``, a ``torchserve``-style handler (made by the test that serves it)."""


def build(root: Path, code: Path) -> None:
    """The digits store with ``NAME`` answered by ``Where``, batching up to ``MAX_BATCH`` payloads."""
    build_store(root, code)
    (code / f"{MODULE}.py").write_text(CODE)
    with_handler(root, NAME, f"{MODULE}:Where", timeout_s=TIMEOUT_S)
    manifest_file = root / NAME / storage.MANIFEST
    manifest = json.loads(manifest_file.read_text())
    manifest["batching"] = {"max_batch_size": MAX_BATCH, "max_delay_ms": 2000.0}
    manifest_file.write_text(json.dumps(manifest))


def processes(root: Path, code: Path, placement: str = "instance_processes") -> Settings:
    return Settings(store=root, code_path=[code], placement=placement)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("handler-in-instance")
    code = root.parent / "handler-in-instance-code"
    build(root, code)
    return root, code


async def expected_digits(client: httpx.AsyncClient) -> list[int]:
    files = [("data", (f"{i}.csv", csv(row), "text/csv")) for i, row in enumerate(digits_rows()[:MAX_BATCH])]
    r = await client.post(f"/predictions/{NAME}", files=files)
    assert r.status_code == 200, r.text
    return [a["digit"] for a in r.json()]


async def test_the_handler_runs_in_the_instance_process_one_batch_for_concurrent_requests(
    store: tuple[Path, Path],
) -> None:
    root, code = store
    rows = digits_rows()[:MAX_BATCH]
    async with started(processes(root, code), NAME) as client:
        expected = await expected_digits(client)
        assert len(set(expected)) > 2  # the rows differ, so answers crossed between requests would show
        answers = await asyncio.gather(*(client.put(f"/predictions/{NAME}", content=csv(row)) for row in rows))
        stats = (await client.get(f"/models/{NAME}/stats")).json()
    assert [r.status_code for r in answers] == [200] * MAX_BATCH, [r.text for r in answers]
    # The model's statistics count the handler batches run in the instance process: the form's, then this one.
    assert (stats["batches"], stats["rows"], stats["batch_size_histogram"]) == (2, 2 * MAX_BATCH, {"4": 2})
    bodies = [r.json() for r in answers]
    assert [b["digit"] for b in bodies] == expected
    pids = {b["pid"] for b in bodies}
    assert len(pids) == 1
    assert pids != {os.getpid()}  # not run on this process's handler threads
    assert [b["batch"] for b in bodies] == [MAX_BATCH] * MAX_BATCH  # one postprocess for all four


async def test_one_bad_payload_among_good_ones_fails_alone_in_the_instance_process(store: tuple[Path, Path]) -> None:
    root, code = store
    bodies = [csv(row) for row in digits_rows()[:MAX_BATCH]]
    bodies[1] = b"x," + bodies[1]
    async with started(processes(root, code), NAME) as client:
        expected = await expected_digits(client)
        answers = await asyncio.gather(*(client.put(f"/predictions/{NAME}", content=b) for b in bodies))
    assert [r.status_code for r in answers] == [200, 400, 200, 200], [r.text for r in answers]
    bad = answers[1].json()
    assert bad["message"] == "handler preprocess failed: ValueError: could not convert string to float: 'x'"
    good = [answers[i].json() for i in (0, 2, 3)]
    assert [a["digit"] for a in good] == [expected[0], *expected[2:]]
    assert [a["batch"] for a in good] == [1, 1, 1]  # each rerun alone
    assert {a["pid"] for a in good} != {os.getpid()}


async def test_a_handler_wrong_in_the_instance_process_is_answered_as_on_handler_threads(
    store: tuple[Path, Path],
) -> None:
    root, code = store
    async with started(processes(root, code), NAME) as client:
        slow = await client.put(f"/predictions/{NAME}", content=b"slow")
        rows = await client.put(f"/predictions/{NAME}", content=b"rows")
        good = await client.put(f"/predictions/{NAME}", content=csv(digits_rows()[0]))
    assert slow.status_code == 504, slow.text
    limit = f"model {NAME!r}: handler preprocess ran past its time limit of {TIMEOUT_S:g} s (handler.timeout_s)"
    assert slow.json()["message"] == limit
    assert rows.status_code == 500, rows.text
    assert "handler preprocess returned 'pixels' with 2 rows; expected 1, one per payload" in rows.json()["message"]
    assert good.status_code == 200, good.text
    assert good.json()["pid"] != os.getpid()


@pytest.mark.parametrize("placement", ["instance_processes", "instance_threads"])
async def test_a_light_request_batched_with_one_past_the_time_limit_is_answered_from_its_own_call(
    store: tuple[Path, Path], placement: str
) -> None:
    """The heavy request's payload makes the batch's ``preprocess`` run past its limit: the batch is rerun one request
    per call, the light one first, so only the heavy one gets the 504."""
    root, code = store
    heavy = b"slow" + b" " * 10_000
    async with started(processes(root, code, placement), NAME) as client:
        expected = await expected_digits(client)
        sent = [heavy, *(csv(row) for row in digits_rows()[1:MAX_BATCH])]  # one batch: MAX_BATCH payloads
        answers = await asyncio.gather(*(client.put(f"/predictions/{NAME}", content=b) for b in sent))
    assert [r.status_code for r in answers] == [504, 200, 200, 200], [r.text for r in answers]
    limit = f"model {NAME!r}: handler preprocess ran past its time limit of {TIMEOUT_S:g} s (handler.timeout_s)"
    assert answers[0].json()["message"] == limit
    good = [r.json() for r in answers[1:]]
    assert [a["digit"] for a in good] == expected[1:]
    assert [a["batch"] for a in good] == [1, 1, 1]  # each from a call of its own


@pytest.mark.parametrize("placement", ["instance_processes", "instance_threads"])
async def test_kserve_v1_instances_of_torchserve_s_envelope_are_the_handler_s_payloads(
    store: tuple[Path, Path], placement: str
) -> None:
    """KServe's TorchServe predictor sends ``{"instances": [{"data": "<base64>"}]}``: each instance is one payload of
    the handler batch, as a file of a form is, its base64 decoded to the bytes a ``halfserve``-style handler reads;
    the answer is ``{"predictions": [...]}`` in order. A bad instance is a 400 naming it, and serving goes on."""
    root, code = store
    rows = digits_rows()[:MAX_BATCH]
    instances = [{"data": b64(row)} for row in rows]
    async with started(processes(root, code, placement), NAME) as client:
        expected = await expected_digits(client)
        r = await client.post(f"/v1/models/{NAME}:predict", json={"instances": instances})
        assert r.status_code == 200, r.text
        predictions = r.json()["predictions"]
        assert [p["digit"] for p in predictions] == expected
        assert [p["batch"] for p in predictions] == [MAX_BATCH] * MAX_BATCH  # one preprocess for the four
        assert ({p["pid"] for p in predictions} == {os.getpid()}) == (placement == "instance_threads")
        bad = await client.post(f"/v1/models/{NAME}:predict", json={"instances": [instances[0], {"data": "x,1"}]})
        number = await client.post(f"/v1/models/{NAME}:predict", json={"instances": [{"body": 7}]})
        other = await client.post(f"/v1/models/{NAME}:predict", json={"instances": [{"data": "eA==", "id": 1}]})
        again = await client.post(f"/v1/models/{NAME}:predict", json={"instances": [{"body": instances[2]["data"]}]})
    assert (bad.status_code, bad.json()) == (
        400,
        {"error": "instances[1].data: not base64 (standard alphabet, padded)"},
    )
    assert (number.status_code, number.json()) == (
        400,
        {"error": "instances[0].body: expected a string (base64 of bytes, or a text), got int"},
    )
    assert (other.status_code, other.json()) == (
        400,
        {"error": "instances[0]: names data, id; give one of data or body, the request's payload"},
    )
    assert again.status_code == 200, again.text
    assert [p["digit"] for p in again.json()["predictions"]] == [expected[2]]


async def test_a_torchserve_style_handler_in_an_instance_process_is_given_a_v1_instance_s_text_as_sent(
    store: tuple[Path, Path], tmp_path: Path
) -> None:
    """TorchServe hands a KServe instance's ``data`` to its handler as it is: a text model's handler reads the text
    (a photo handler base64-decodes it). Carried to the instance process, it stays a text; a raw body stays bytes."""
    root, code = store
    shutil.copytree(root, tmp_path / "store")
    with_handler(tmp_path / "store", TEXT_NAME, f"{MODULE}:TextDigits", style="torchserve")
    rows = digits_rows()[:MAX_BATCH]
    settings = Settings(store=tmp_path / "store", code_path=[code], placement="instance_processes", models=[TEXT_NAME])  # type: ignore[arg-type]
    async with started(settings, TEXT_NAME) as client:
        tensors = (rows.astype(np.float32) / 16).reshape(-1, 1, 8, 8).tolist()
        fed = await client.post("/predict", json={"model": TEXT_NAME, "inputs": tensors})  # the model, unhandled
        assert fed.status_code == 200, fed.text
        expected = [int(np.argmax(o)) for o in fed.json()["outputs"]]
        instances = [{"data": csv(row).decode()} for row in rows[:-1]] + [{"body": csv(rows[-1]).decode()}]
        r = await client.post(f"/v1/models/{TEXT_NAME}:predict", json={"instances": instances})
        raw = await client.put(f"/predictions/{TEXT_NAME}", content=csv(rows[0]))
    assert r.status_code == 200, r.text
    predictions = r.json()["predictions"]
    assert [p["digit"] for p in predictions] == expected
    assert [p["given"] for p in predictions] == ["str"] * MAX_BATCH
    assert {p["pid"] for p in predictions} != {os.getpid()}  # run in the instance process
    assert raw.status_code == 200, raw.text
    assert (raw.json()["digit"], raw.json()["given"]) == (expected[0], "bytes")


@pytest.mark.parametrize("placement", ["instance_processes", "instance_threads"])
async def test_a_torchserve_style_handler_runs_no_call_beside_one_past_its_time_limit(
    store: tuple[Path, Path], tmp_path: Path, placement: str
) -> None:
    """A TorchServe handler keeps its batch's state on itself, so it runs one batch at a time: a call past its time
    limit (answered 504) still runs on it, and the next request waits for it rather than run beside it and be
    answered with that call's state. Refused busy when the call still runs after the time limit; once it returned,
    a request gets its own answer."""
    root, code = store
    shutil.copytree(root, tmp_path / "store")
    with_handler(tmp_path / "store", KEEPS_NAME, f"{MODULE}:KeepsTag", style="torchserve", timeout_s=TIMEOUT_S)
    release = tmp_path / "release"
    settings = Settings(store=tmp_path / "store", code_path=[code], placement=placement, models=[KEEPS_NAME])  # type: ignore[arg-type]
    url = f"/predictions/{KEEPS_NAME}"
    async with started(settings, KEEPS_NAME) as client:
        held = await client.put(url, content=f"hold {release}".encode())
        beside = await client.put(url, content=b"beside")
        release.touch()  # the held call returns
        deadline = asyncio.get_running_loop().time() + DEADLINE_S
        while (after := await client.put(url, content=b"after")).status_code == 503:
            assert asyncio.get_running_loop().time() < deadline, after.text
    assert held.status_code == 504, held.text
    assert "tag" not in beside.json(), beside.text  # never the held call's
    assert beside.status_code == 503, beside.text
    message = beside.json()["message"]
    assert (
        "handler preprocess: the handler of model 'digits_keeps' still ran an earlier call past its time limit"
        in message
    )
    assert after.status_code == 200, after.text
    assert after.json() == {"tag": "after"}
