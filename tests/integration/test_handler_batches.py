"""A team's handler called per batch (issue 51) on the app with its lifespan: concurrent ``/predictions`` requests to
one handler model reach one ``preprocess`` and one ``postprocess`` (the handler, written by the test to a
``--code-path`` folder, records each call's number of requests), each request gets its own answers in order, and one
bad payload among good ones fails alone: its batch is rerun one request per call."""

from __future__ import annotations

import asyncio
import base64
import gc
import json
import textwrap
from pathlib import Path

import httpx
import pytest

from halfserve import storage
from halfserve.settings import Settings
from tests.e2e.test_handlers import HANDLER_CODE, b64, build_store, csv, digits_rows, with_handler
from tests.integration.test_v2 import AUTH, TOKEN
from tests.security.test_model_code import started
from tests.waiting import freed

pytestmark = pytest.mark.slow

BATCHED = "digits_batched"
RECORDING = "digits_batch_handlers"
"""The recording handler's module: a name of its own, as a module once imported stays so for the whole process."""
MAX_BATCH = 4
"""The batched model's max_batch_size: as many payloads as each test sends at once, so that the batch is cut when
they are all queued, not by the delay (which a loaded host could outlast between two requests)."""


def recording_code(log: Path) -> str:
    return HANDLER_CODE + textwrap.dedent(
        f"""

        class Recording(Digits):
            def preprocess(self, requests):
                with open({str(log)!r}, "a") as f:
                    f.write(f"pre {{len(requests)}}\\n")
                return super().preprocess(requests)

            def postprocess(self, outputs, requests):
                with open({str(log)!r}, "a") as f:
                    f.write(f"post {{len(requests)}}\\n")
                return super().postprocess(outputs, requests)
        """
    )


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    root = tmp_path_factory.mktemp("handler-batches")
    code = root.parent / "handler-batches-code"
    log = root.parent / "handler-calls.log"
    build_store(root, code)
    (code / f"{RECORDING}.py").write_text(recording_code(log))
    with_handler(root, BATCHED, f"{RECORDING}:Recording")
    manifest_file = root / BATCHED / storage.MANIFEST
    manifest = json.loads(manifest_file.read_text())
    manifest["batching"] = {"max_batch_size": MAX_BATCH, "max_delay_ms": 2000.0}
    manifest_file.write_text(json.dumps(manifest))
    return root, code, log


def calls(log: Path) -> list[str]:
    text = log.read_text() if log.exists() else ""
    log.write_text("")
    return text.splitlines()


async def expected_digits(client: httpx.AsyncClient) -> list[int]:
    """The digits of the rows, asked in one form: one request, so no batch of several to get wrong."""
    files = [("data", (f"{i}.csv", csv(row), "text/csv")) for i, row in enumerate(digits_rows()[:MAX_BATCH])]
    r = await client.post(f"/predictions/{BATCHED}", files=files)
    assert r.status_code == 200, r.text
    return [a["digit"] for a in r.json()]


async def test_concurrent_requests_are_one_handler_batch_answered_in_order(store: tuple[Path, Path, Path]) -> None:
    root, code, log = store
    rows = digits_rows()[:MAX_BATCH]
    async with started(Settings(store=root, code_path=[code]), BATCHED) as client:
        expected = await expected_digits(client)
        assert len(set(expected)) > 2  # the rows differ, so answers crossed between requests would show
        calls(log)
        one = client.put(f"/predictions/{BATCHED}", content=csv(rows[0]))
        form = client.post(
            f"/predictions/{BATCHED}",
            files=[("data", ("1.csv", csv(rows[1]), "text/csv")), ("data", ("2.csv", csv(rows[2]), "text/csv"))],
        )
        last = client.put(f"/predictions/{BATCHED}", content=csv(rows[3]))
        answers = await asyncio.gather(one, form, last)
    assert [r.status_code for r in answers] == [200, 200, 200], [r.text for r in answers]
    assert answers[0].json()["digit"] == expected[0]
    assert [a["digit"] for a in answers[1].json()] == expected[1:3]
    assert answers[2].json()["digit"] == expected[3]
    assert calls(log) == [f"pre {MAX_BATCH}", f"post {MAX_BATCH}"]


async def test_one_bad_payload_among_good_ones_fails_alone(store: tuple[Path, Path, Path]) -> None:
    root, code, log = store
    rows = digits_rows()[:MAX_BATCH]
    bodies = [csv(row) for row in rows]
    bodies[1] = b"x," + bodies[1]
    async with started(Settings(store=root, code_path=[code]), BATCHED) as client:
        expected = await expected_digits(client)
        calls(log)
        answers = await asyncio.gather(*(client.put(f"/predictions/{BATCHED}", content=b) for b in bodies))
        after = await client.put(f"/predictions/{BATCHED}", content=bodies[0])  # the server serves on
    assert [r.status_code for r in answers] == [200, 400, 200, 200], [r.text for r in answers]
    bad = answers[1].json()
    assert bad["message"] == "handler preprocess failed: ValueError: could not convert string to float: 'x'"
    assert bad["type"] == "BadRequestException"
    assert [answers[i].json()["digit"] for i in (0, 2, 3)] == [expected[0], *expected[2:]]
    assert after.status_code == 200
    # One call of the batch, then one per request alone (and the request after); a postprocess for each good one.
    made = calls(log)
    assert made[0] == f"pre {MAX_BATCH}"
    assert sorted(made[1:]) == ["post 1"] * 4 + ["pre 1"] * 5


async def test_a_payload_the_handler_makes_nan_or_infinite_is_refused_alone(store: tuple[Path, Path, Path]) -> None:
    """A CSV cell of ``nan``, or of ``1e308`` (infinite as float32), read by the handler into the model's input: a 400
    for that request as for a tensor holding one (the model takes no such values), the others answered."""
    root, code, _ = store
    rows = digits_rows()[:MAX_BATCH]
    bodies = [csv(row) for row in rows]
    bodies[1] = b"nan," + bodies[1].split(b",", 1)[1]
    bodies[2] = b"1e308," + bodies[2].split(b",", 1)[1]
    async with started(Settings(store=root, code_path=[code]), BATCHED) as client:
        expected = await expected_digits(client)
        answers = await asyncio.gather(*(client.put(f"/predictions/{BATCHED}", content=b) for b in bodies))
    assert [r.status_code for r in answers] == [200, 400, 400, 200], [r.text for r in answers]
    assert answers[1].json()["message"] == (
        "handler preprocess returned 'pixels': row 0 holds a NaN or infinite value (or one beyond the range of "
        f"float32); model {BATCHED!r} does not accept them (allow_nonfinite_inputs)"
    )
    assert [answers[i].json()["digit"] for i in (0, 3)] == [expected[0], expected[3]]


async def test_a_payload_the_handler_refuses_is_freed_with_its_answer(store: tuple[Path, Path, Path]) -> None:
    """The handler's error held, through its traceback, the handler thread's frames, one of which the error in turn,
    and the payloads they read: a cycle only a collection of the collector's older generations freed, and a server
    refusing 16 payloads of 160 KB a request grew by 166 MB in 60 requests. The collector is off here, so what a
    collection would free shows as still alive."""
    root, code, _ = store
    marker = "q" * 17
    bad = f"x{marker},".encode() + csv(digits_rows()[0])
    async with started(Settings(store=root, code_path=[code]), BATCHED) as client:
        gc.collect()
        gc.disable()
        try:
            for _ in range(3):
                refused = await client.put(f"/predictions/{BATCHED}", content=bad)
                assert refused.status_code == 400, refused.text
                assert marker in refused.json()["message"]
            await freed(
                lambda: sum(isinstance(o, ValueError) and marker in str(o) for o in gc.get_objects()),
                "the handler's refusals freed",
            )
        finally:
            gc.enable()


async def test_an_unloaded_handler_model_answers_its_state_before_its_handler_or_base64_runs(
    store: tuple[Path, Path, Path],
) -> None:
    """KServe V1's TorchServe envelope to an unloaded model with a handler: 503 'unloaded', as ``/predictions`` and
    V1's tensors answer, whatever the instances hold; its base64 is not decoded nor its handler called (a payload the
    handler refuses had been its 400, bad base64 a 400 naming the instance)."""
    root, code, log = store
    rows = digits_rows()[:2]
    settings = Settings(store=root, code_path=[code], admin_token=TOKEN)
    async with started(settings, BATCHED) as client:
        assert (await client.post(f"/models/{BATCHED}/unload", headers=AUTH)).status_code == 200
        calls(log)
        sent = [[{"data": b64(rows[0])}], [{"data": base64.b64encode(b"boom").decode()}], [{"data": "!!"}]]
        answers = [await client.post(f"/v1/models/{BATCHED}:predict", json={"instances": i}) for i in sent]
        tensors = await client.post(f"/v1/models/{BATCHED}:predict", json={"instances": [[[[0.0] * 8] * 8]]})
    for r in [*answers, tensors]:
        assert (r.status_code, r.json()) == (503, {"error": f"model {BATCHED!r} is unloaded"})
    assert calls(log) == []
