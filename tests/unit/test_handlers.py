"""The handler section and its calls without a server: the section's form, the trust rule (code only from a
``--code-path`` folder, nothing imported to decide), what a client is told of an exception, and the bound on calls,
which a call past its time limit keeps its place in until its thread returns (Python cannot stop a thread)."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
from pydantic import ValidationError

from halfserve import handlers, models
from halfserve.handlerinput import HandlerSection
from halfserve.handlers import HandlerBusyError, HandlerLoadError, HandlerRaisedError, HandlerTimeoutError, Stage
from halfserve.settings import MAX_IMAGE_PIXELS
from tests.waiting import DEADLINE_S, until

LIMIT_S = 0.5
"""The time limit of a call held until the test releases it, which it runs past. It must first get its thread within
the same limit (else it is refused busy), which a loaded host may take tens of milliseconds to start; short for the
test to wait out."""


@pytest.mark.parametrize("code", ["os.system", "a:b.c", "a:", ":b", "a b:c", "x" * 300 + ":y"])
def test_a_section_names_module_and_name(code: str) -> None:
    with pytest.raises(ValidationError):
        HandlerSection(code=code)


@pytest.mark.parametrize("timeout_s", [0, -1, 601])
def test_the_time_limit_is_bounded(timeout_s: float) -> None:
    with pytest.raises(ValidationError):
        HandlerSection(code="a:B", timeout_s=timeout_s)


def test_code_outside_the_code_path_is_refused_and_not_imported(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "outside_handler.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\nclass H: pass\n")
    with pytest.raises(HandlerLoadError, match="--code-path"):
        handlers.build(HandlerSection(code="outside_handler:H"))
    with pytest.raises(HandlerLoadError, match="--code-path"):
        handlers.build(HandlerSection(code="os:system"))
    assert not marker.exists()


def test_a_handler_needs_both_methods(tmp_path: Path) -> None:
    (tmp_path / "half_handler.py").write_text("class H:\n    def preprocess(self, requests): return requests\n")
    models.add_code_path([tmp_path])
    with pytest.raises(HandlerLoadError, match="has no postprocess"):
        handlers.build(HandlerSection(code="half_handler:H"))


def test_a_reason_is_one_short_line_without_addresses() -> None:
    e = ValueError("bad\n  value <object at 0x7f00deadbeef>" + "x" * 1000)
    reason = handlers.one_line(e, "handler preprocess failed: ")
    assert reason.startswith("handler preprocess failed: ValueError: bad value <object>")
    assert "\n" not in reason
    assert len(reason) == handlers.REASON_CHARS
    assert reason.endswith("...")


async def test_an_exception_is_the_calls_failure() -> None:
    def fails() -> None:
        raise SystemExit("the team's code exits")

    with pytest.raises(HandlerRaisedError, match="handler postprocess failed: SystemExit: the team's code exits"):
        await handlers.run(Stage.POSTPROCESS, fails, 5, "m")


async def test_a_call_past_its_limit_keeps_its_place_until_it_returns(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(handlers, "HANDLER_THREADS", 1)
    monkeypatch.setattr(handlers, "HANDLER_QUEUE", 0)
    release = threading.Event()
    with pytest.raises(HandlerTimeoutError, match=rf"preprocess ran past its time limit of {LIMIT_S:g} s"):
        await handlers.run(Stage.PREPROCESS, release.wait, LIMIT_S, "m")
    assert handlers.running("m") == 1
    with pytest.raises(HandlerBusyError):
        await handlers.run(Stage.PREPROCESS, lambda: 1, 5, "m")
    release.set()
    await until(lambda: handlers.running("m") == 0, "the stuck call returned")
    assert await handlers.run(Stage.PREPROCESS, lambda: 2, 5, "m") == 2


async def test_a_call_that_gets_no_thread_within_its_limit_is_busy_and_never_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The time limit is the call's own: one queued behind a call past its limit (which holds the only thread) is
    refused busy (a 503 to retry), not answered as past its time limit, and is withdrawn, never run."""
    monkeypatch.setattr(handlers, "HANDLER_THREADS", 1)
    monkeypatch.setattr(handlers, "HANDLER_QUEUE", 1)
    release, ran = threading.Event(), threading.Event()
    with pytest.raises(HandlerTimeoutError):
        await handlers.run(Stage.PREPROCESS, release.wait, LIMIT_S, "held")
    with pytest.raises(HandlerBusyError, match=r"no handler thread of model 'held' came free within 0\.05 s"):
        await handlers.run(Stage.PREPROCESS, ran.set, 0.05, "held")
    release.set()
    await until(lambda: handlers.running("held") == 0, "the stuck call returned")
    assert await handlers.run(Stage.PREPROCESS, lambda: 4, 5, "held") == 4
    assert not ran.is_set()


async def test_a_call_past_its_limit_holds_its_payload_bytes_until_it_returns() -> None:
    release = threading.Event()
    with pytest.raises(HandlerTimeoutError):
        await handlers.run(Stage.PREPROCESS, release.wait, LIMIT_S, "stuck", 100)
    assert handlers.stuck_bytes("stuck") == 100
    release.set()
    await until(lambda: handlers.stuck_bytes("stuck") == 0, "the stuck call returned")
    assert await handlers.run(Stage.PREPROCESS, lambda: 5, 5, "stuck", 100) == 5
    assert handlers.stuck_bytes("stuck") == 0  # a call within its limit is not counted


async def test_a_model_whose_calls_hang_holds_only_its_own_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each model has its threads and its bound: one whose handler hangs is refused busy, another answers at once."""
    monkeypatch.setattr(handlers, "HANDLER_THREADS", 1)
    monkeypatch.setattr(handlers, "HANDLER_QUEUE", 0)
    release = threading.Event()
    with pytest.raises(HandlerTimeoutError):
        await handlers.run(Stage.PREPROCESS, release.wait, LIMIT_S, "hangs")
    with pytest.raises(HandlerBusyError, match="of model 'hangs'"):
        await handlers.run(Stage.PREPROCESS, lambda: 1, 5, "hangs")
    assert await handlers.run(Stage.PREPROCESS, lambda: 3, 5, "other") == 3
    release.set()
    await until(lambda: handlers.running("hangs") == 0, "the stuck call returned")


async def test_a_handler_taking_one_call_at_a_time_runs_none_beside_one_past_its_limit() -> None:
    """``exclusive`` (a TorchServe handler, which keeps its batch's state on itself): the next call on the object
    waits for the one past its limit, refused busy and never run while that one still runs, run once it returned;
    another object's calls go on meanwhile."""
    handler, other = object(), object()
    release, ran = threading.Event(), threading.Event()
    with pytest.raises(HandlerTimeoutError):
        await handlers.run(Stage.PREPROCESS, release.wait, LIMIT_S, "one", exclusive=handler)
    with pytest.raises(HandlerBusyError, match=r"still ran an earlier call past its time limit after 0\.05 s"):
        await handlers.run(Stage.POSTPROCESS, ran.set, 0.05, "one", exclusive=handler)
    assert not handlers.wait_free(handler, 0.05)
    assert await handlers.run(Stage.PREPROCESS, lambda: 2, 5, "one", exclusive=other) == 2
    release.set()
    assert await handlers.run(Stage.PREPROCESS, lambda: 3, DEADLINE_S, "one", exclusive=handler) == 3
    assert handlers.wait_free(handler, 0)
    assert not ran.is_set()


def test_a_handler_building_holds_only_its_own_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A build that hangs (a TorchServe handler's initialize) does not stop another model's handler from being found
    or built: the load of that one, and requests to it, go on."""
    release, started = threading.Event(), threading.Event()

    def build(section: HandlerSection, *args: object) -> object:
        if section.code == "slow_handler:H":
            started.set()
            release.wait()
        return section.code

    monkeypatch.setattr(handlers, "build", build)
    slow = threading.Thread(target=handlers.handler, args=(tmp_path, "slow", 1, HandlerSection(code="slow_handler:H")))
    slow.start()
    assert started.wait(30)
    found: list[object] = []
    other = threading.Thread(
        target=lambda: found.append(handlers.handler(tmp_path, "fast", 1, HandlerSection(code="fast_handler:H")))
    )
    other.start()
    try:
        other.join(30)  # bounded: with one lock for all models this waits for the slow build
        assert found == ["fast_handler:H"]
    finally:
        release.set()
        slow.join(30)


async def test_a_build_past_its_limit_fails_every_caller_at_the_limit_and_runs_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A front-end process builds its own handler on its first request: a build that hangs answered no request to
    that model, and each held a thread waiting on the build's lock. Now every caller is told at the build's limit,
    holding no thread; the one build runs on, and once it returns its handler serves."""
    monkeypatch.setattr(handlers, "BUILD_TIMEOUT_S", LIMIT_S)
    release = threading.Event()
    builds: list[str] = []

    def build(section: HandlerSection, *args: object) -> object:
        builds.append(section.code)
        release.wait()
        return section.code

    monkeypatch.setattr(handlers, "build", build)
    section = HandlerSection(code="hung_handler:H")
    callers = [handlers.handler_in_time(tmp_path, "hung", 1, section) for _ in range(3)]
    failures = await asyncio.gather(*callers, return_exceptions=True)
    assert [str(f) for f in failures] == [
        f"handler 'hung_handler:H': building it (its initialize) ran past {LIMIT_S:g} s"
    ] * 3
    assert all(isinstance(f, HandlerLoadError) for f in failures)
    with pytest.raises(HandlerLoadError, match="ran past"):  # a later caller, while the build still runs
        await handlers.handler_in_time(tmp_path, "hung", 1, section)
    assert builds == ["hung_handler:H"]
    release.set()
    await until(lambda: handlers.built(tmp_path, "hung", 1, section, MAX_IMAGE_PIXELS) is not None, "the build ended")
    assert await handlers.handler_in_time(tmp_path, "hung", 1, section) == "hung_handler:H"
    assert builds == ["hung_handler:H"]
