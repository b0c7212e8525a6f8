"""A team's handler where the model's instances are processes (issue 51): each handler batch goes to an instance
process as its raw payloads, and ``preprocess``, the forward and ``postprocess`` run there (the handler's answers
carry the pid that ran them: not this one's), concurrent requests still make one batch, and one bad payload among
good ones fails alone (the batch is rerun one request per call, in the instance process too)."""

from __future__ import annotations

import asyncio
import json
import os
import textwrap
from pathlib import Path

import httpx
import pytest

from halfserve import storage
from halfserve.settings import Settings
from tests.e2e.test_handlers import HANDLER_CODE, build_store, csv, digits_rows, with_handler
from tests.security.test_model_code import started

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
    """
)


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
