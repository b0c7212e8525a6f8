"""Tokenizing is kept off the event loop and bounded per request: while a request's texts are being tokenized,
``/health`` and other clients are answered (a 4 MiB text request used to stall ``/health`` for seconds), and a
request carrying more text than ``max_text_bytes`` (all rows together) is a 413 before any of it is tokenized.

The tokenizer here is the real one behind a stand-in that holds a marked request's tokenizing until the test lets it
go, so "answered while tokenizing" is an ordering the test observes, not a time it measures."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest

from halfserve import text
from halfserve.settings import Settings
from tests.integration.conftest import serving
from tests.integration.test_text import INFER, save_texty
from tests.waiting import DEADLINE_S, until

pytest.importorskip("tokenizers")

HELD = "hold"


class HeldTokenizer:
    """The real tokenizer, but a batch holding the word ``hold`` waits for ``release`` (at most the deadline, which
    bounds a hang when tokenizing blocks the loop that would release it)."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.started = threading.Event()
        self.release = threading.Event()
        self.finished = threading.Event()
        self.calls = 0

    def __getattr__(self, name: str) -> Any:  # the rest of the tokenizer's reading (its vocabulary's size)
        return getattr(self.real, name)

    def encode_batch(self, strings: list[str]) -> Any:
        self.calls += 1
        if any(HELD in s for s in strings):
            self.started.set()
            self.release.wait(DEADLINE_S)
            self.finished.set()
        return self.real.encode_batch(strings)


@pytest.fixture
def held(monkeypatch: pytest.MonkeyPatch) -> HeldTokenizer:
    real_tokenizer = text._tokenizer
    stand_in: dict[str, HeldTokenizer] = {}

    def tokenizer(path: Path, mtime: float) -> Any:
        return stand_in.setdefault("held", HeldTokenizer(real_tokenizer(path, mtime)))

    monkeypatch.setattr(text, "_tokenizer", tokenizer)
    return _Lazy(stand_in)  # type: ignore[return-value]


class _Lazy:
    """The stand-in, made when the server first reads the tokenizer (at load)."""

    def __init__(self, made: dict[str, HeldTokenizer]) -> None:
        self._made = made

    def __getattr__(self, name: str) -> Any:
        return getattr(self._made["held"], name)


def request(route: str, texts: list[str]) -> tuple[str, dict[str, Any]]:
    if route == "predict":
        return "/predict", {"inputs": texts}
    return INFER, {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [len(texts)], "data": texts}]}


@pytest.mark.parametrize("route", ["predict", "v2"])
async def test_health_and_other_requests_are_answered_while_a_request_is_tokenized(
    tmp_path: Path, held: HeldTokenizer, route: str
) -> None:
    async with serving(Settings(store=save_texty(tmp_path), precision="fp32")) as client:
        path, body = request(route, [f"{HELD} the quick brown fox", "a short text"])
        slow = asyncio.create_task(client.post(path, json=body))
        await until(held.started.is_set, "the held request to start tokenizing")
        health = await client.get("/health")
        other_path, other_body = request(route, ["a short text"])
        other = await client.post(other_path, json=other_body)
        # Both answered while the held request's tokenizing was still under way.
        assert not held.finished.is_set()
        held.release.set()
        assert health.status_code == 200
        assert other.status_code == 200, other.text
        answer = await slow
        assert answer.status_code == 200, answer.text


async def test_more_text_than_max_text_bytes_is_a_413_before_tokenizing(tmp_path: Path, held: HeldTokenizer) -> None:
    texts = ["q" * 300] * 4  # 300 bytes each (under text.max_bytes 400), 1200 together; one token each ([UNK])
    async with serving(Settings(store=save_texty(tmp_path), precision="fp32", max_text_bytes=1000)) as client:
        for route in ("predict", "v2"):
            path, body = request(route, texts)
            r = await client.post(path, json=body)
            assert r.status_code == 413, r.text
            assert "texts of more than 1000 bytes in one request (max_text_bytes)" in r.json()["error"]
        assert held.calls == 0
        path, body = request("predict", texts[:3])
        fits = await client.post(path, json=body)
        assert fits.status_code == 200, fits.text
        assert held.calls == 1
