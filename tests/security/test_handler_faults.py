"""A team's handler that goes wrong is that request's answer, never the server's (issue 51): raising in
``preprocess`` is a 400, in ``postprocess`` a 500, inputs of the wrong shape, rows or dtype and answers of the wrong
number or not JSON-able a 500 naming what was expected and what came, a handler past its time limit a 504; each with
a one-line reason (no traceback, no object address), in TorchServe's error shape, while the good model beside it goes
on answering."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.conftest import ServerProcess, StartServer
from tests.e2e.test_handlers import MODEL, MODULE, TIMEOUT, build_store, csv, digits_rows, with_handler

pytestmark = pytest.mark.slow

FAULTS = {
    "raises": ("Raises", 400, "handler preprocess failed: ValueError: row 1: 'x' is not a number <Digits object>"),
    "post_raises": ("PostRaises", 500, "handler postprocess failed: KeyError: 'label'"),
    "wrong_shape": ("WrongShape", 500, "handler preprocess returned 'pixels': unexpected shape"),
    "wrong_rows": ("WrongRows", 500, "handler preprocess returned 'pixels' with 3 rows; expected 2, one per payload"),
    "wrong_dtype": ("WrongDtype", 500, "'pixels': expected numbers, got an array of complex64"),
    "too_few": ("TooFewAnswers", 500, "handler postprocess returned 1 answers; expected 2, one per payload"),
    "not_json": ("NotJson", 500, "handler postprocess answer 0 is not JSON-able: TypeError"),
    "slow": ("Slow", 504, "handler preprocess ran past its time limit of 0.5 s (handler.timeout_s)"),
}
"""Model name: (the handler class of tests/e2e/test_handlers.py, the status, what the message must hold)."""


@pytest.fixture(scope="module")
def server(server_factory: StartServer, tmp_path_factory: pytest.TempPathFactory) -> ServerProcess:
    root = tmp_path_factory.mktemp("faulty-handlers")
    code = root.parent / "faulty-code"
    build_store(root, code)
    for name, (cls, _, _) in FAULTS.items():
        with_handler(root, name, f"{MODULE}:{cls}", **({"timeout_s": 0.5} if name == "slow" else {}))
    return server_factory(root, "--code-path", str(code))


def two_rows() -> list[tuple[str, tuple[str, bytes, str]]]:
    return [("data", (f"{i}.csv", csv(row), "text/csv")) for i, row in enumerate(digits_rows()[:2])]


@pytest.mark.parametrize("name", list(FAULTS))
def test_a_faulty_handler_is_its_requests_answer_and_the_server_serves_on(server: ServerProcess, name: str) -> None:
    _, status, reason = FAULTS[name]
    r = httpx.post(f"{server.url}/predictions/{name}", files=two_rows(), timeout=TIMEOUT)
    assert r.status_code == status, r.text
    body = r.json()
    assert body["code"] == status
    message = body["message"]
    assert reason in message
    assert "\n" not in message
    assert "Traceback" not in message
    assert " at 0x" not in message
    assert len(message) < 500
    good = httpx.post(f"{server.url}/predictions/{MODEL}", files=two_rows(), timeout=TIMEOUT)
    assert good.status_code == 200, good.text
    assert len(good.json()) == 2


def test_a_long_reason_is_cut(server: ServerProcess) -> None:
    """A CSV of 5,000 bad values: the float() error quotes only its first; the reason stays one short line."""
    r = httpx.put(f"{server.url}/predictions/{MODEL}", content=b"y" * 5000 + b",1", timeout=TIMEOUT)
    assert r.status_code == 400, r.text
    message = r.json()["message"]
    assert message.startswith("handler preprocess failed: ValueError: could not convert string to float")
    assert message.endswith("...")
    assert len(message) <= 300


def test_an_empty_body_is_refused_before_the_handler_runs(server: ServerProcess) -> None:
    r = httpx.put(f"{server.url}/predictions/{MODEL}", content=b"", timeout=TIMEOUT)
    assert r.status_code == 400, r.text
    assert "body: empty" in r.json()["message"]


def test_too_many_files_are_refused_before_the_handler_runs(server: ServerProcess, tmp_path: Path) -> None:
    files = [("data", (f"{i}.csv", b"0", "text/csv")) for i in range(200)]
    r = httpx.post(f"{server.url}/predictions/{MODEL}", files=files, timeout=TIMEOUT)
    assert r.status_code in (400, 413), r.text
    assert "max_request_images" in r.json()["message"]
