"""A team's handler that kills the instance process it runs in (``os._exit`` in ``preprocess``, issue 51): that
request is answered a 500 naming the process's end, the supervisor restarts the process, the server serves on, and
the next request is answered by the restarted process; in a batch of several, each request is rerun alone, so only the
one that kills it fails."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.e2e.test_handlers import csv, digits_rows
from tests.integration.test_handler_in_instance import MAX_BATCH, NAME, build, processes
from tests.security.test_model_code import started

pytestmark = pytest.mark.slow


async def test_a_handler_that_exits_is_its_request_s_500_and_the_next_request_is_answered(tmp_path: Path) -> None:
    root, code = tmp_path / "store", tmp_path / "code"
    build(root, code)
    row = csv(digits_rows()[0])
    async with started(processes(root, code), NAME) as client:
        before = await client.put(f"/predictions/{NAME}", content=row)
        assert before.status_code == 200, before.text
        killed = await client.put(f"/predictions/{NAME}", content=b"exit")
        after = await client.put(f"/predictions/{NAME}", content=row)
    assert killed.status_code == 500, killed.text
    assert "exited" in killed.json()["message"]
    assert after.status_code == 200, after.text
    assert after.json()["digit"] == before.json()["digit"]
    assert after.json()["pid"] != before.json()["pid"]  # the restarted process answered


async def test_a_handler_that_exits_in_a_batch_of_several_fails_only_its_own_request(tmp_path: Path) -> None:
    root, code = tmp_path / "store", tmp_path / "code"
    build(root, code)
    rows = [csv(row) for row in digits_rows()[:MAX_BATCH]]
    bodies = [rows[0], b"exit", rows[2], rows[3]]  # as many as a batch takes: one batch, cut at once
    async with started(processes(root, code), NAME) as client:
        answers = await asyncio.gather(*(client.put(f"/predictions/{NAME}", content=b) for b in bodies))
        after = await client.put(f"/predictions/{NAME}", content=rows[1])
    assert [r.status_code for r in answers] == [200, 500, 200, 200], [r.text for r in answers]
    assert "exited" in answers[1].json()["message"]
    assert [answers[i].json()["batch"] for i in (0, 2, 3)] == [1, 1, 1]  # rerun alone after the batch's crash
    assert after.status_code == 200, after.text
