"""What one text request may cost the shared tokenizing threads: each text is tokenized no further than its input's
``max_length`` tokens reach (16 texts of 65,000 ``!``, gzipped to about a kilobyte, took the threads 1.5 s whole
before their length was refused), with the same ids as whole for a text that fits; and past the tokenizer's queue a
text request is a 503 with ``Retry-After`` rather than a wait behind work no deadline bounds.

The tokenizer is the real one behind a stand-in that records what it was given, or holds a marked request until the
test lets it go, so the checks are on what was tokenized and in what order, not on a time measured."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gzip
import json
import random
import threading
from pathlib import Path
from typing import Any

import orjson
import pytest

from halfserve import text
from halfserve.manifest import DataType, Manifest, TensorSpec, TextInput
from halfserve.settings import Settings
from tests.integration.conftest import serving
from tests.integration.test_text import CORPUS, INFER, MAX, save_texty, wordpiece
from tests.waiting import DEADLINE_S, until

pytest.importorskip("tokenizers")


class Recording:
    """The real tokenizer; records the longest string it was given, and holds a batch holding ``hold`` until
    ``release`` (at most the deadline)."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.longest = 0
        self.release = threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)

    def encode_batch(self, strings: list[str]) -> Any:
        self.longest = max([self.longest, *map(len, strings)])
        if any("hold" in s for s in strings):
            self.release.wait(DEADLINE_S)
        return self.real.encode_batch(strings)


@pytest.fixture
def recording(monkeypatch: pytest.MonkeyPatch) -> dict[str, Recording]:
    real_tokenizer = text._tokenizer
    made: dict[str, Recording] = {}

    def tokenizer(path: Path, mtime: float) -> Any:
        return made.setdefault("tokenizer", Recording(real_tokenizer(path, mtime)))

    monkeypatch.setattr(text, "_tokenizer", tokenizer)
    return made


def long_texts_allowed(root: Path) -> Path:
    """The texty model, its texts allowed the manifest's default 64 KiB each (the test model's own is 400 bytes)."""
    save_texty(root)
    config = root / "texty" / "config.json"
    manifest = json.loads(config.read_text())
    manifest["text"]["max_bytes"] = 65536
    config.write_text(json.dumps(manifest))
    return root


async def test_a_long_text_is_tokenized_no_further_than_max_length_reaches(
    tmp_path: Path, recording: dict[str, Recording]
) -> None:
    async with serving(Settings(store=long_texts_allowed(tmp_path), precision="fp32")) as client:
        r = await client.post("/predict", json={"inputs": ["!" * 65000] * 16})
        assert r.status_code == 400, r.text
        assert r.json()["error"] == (
            f"inputs.text[0]: input 'tokens': more than {MAX} tokens, longer than its max_length (or set truncate)"
        )
        # Each text was cut to a head of a few hundred characters (24 tokens of at most a dozen characters each),
        # not tokenized whole.
        assert 0 < recording["tokenizer"].longest <= 20 * (MAX + 2)
        fits = await client.post("/predict", json={"inputs": ["a short text"]})
        assert fits.status_code == 200, fits.text


async def test_text_from_a_compressed_body_is_held_to_the_compression_ratio(
    tmp_path: Path, recording: dict[str, Recording]
) -> None:
    texts = ["!" * 65000] * 16
    v2 = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [16], "data": texts}]}
    headers = {"content-encoding": "gzip", "content-type": "application/json"}
    async with serving(Settings(store=long_texts_allowed(tmp_path), precision="fp32")) as client:
        for path, payload, field in [("/predict", {"inputs": texts}, "inputs.text"), (INFER, v2, "inputs[0]")]:
            body = gzip.compress(orjson.dumps(payload))
            assert len(body) < 2000  # about a megabyte of text
            r = await client.post(path, content=body, headers=headers)
            assert r.status_code == 413, r.text
            assert r.json()["error"] == (
                f"{field}: texts of more than {100 * len(body)} bytes from a body of {len(body)} compressed bytes "
                "(max_compression_ratio: 100)"
            )
        assert recording["tokenizer"].longest == 0  # refused before any text was tokenized
        prose = gzip.compress(orjson.dumps({"inputs": ["the quick brown fox jumps over the lazy dog"] * 4}))
        fits = await client.post("/predict", content=prose, headers=headers)
        assert fits.status_code == 200, fits.text


WORDS = ["a", "the", "server", "batches", "requests", "!", ",", "[UNK]", "[PAD]", "é", "e\u0301", "xyzzyplugh" * 12]
SPACES = [" ", "  ", "\t", "\n ", ""]


def random_text(rng: random.Random) -> str:
    return "".join(rng.choice(WORDS) + rng.choice(SPACES) for _ in range(rng.randrange(1, 90)))


def byte_level_bpe(path: Path) -> None:
    """A GPT-2 style tokenizer (a word's leading space is part of its first token), trained here."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok.train_from_iterator(
        CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>"], initial_alphabet=alphabet)
    )
    tok.save(str(path))


def sentencepiece_unigram(path: Path) -> None:
    """A SentencePiece style tokenizer (spaces become ``▁``, NFKC normalized), trained here."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.Unigram())
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    trainer = trainers.UnigramTrainer(vocab_size=100, special_tokens=["<pad>", "<unk>"], unk_token="<unk>")
    tok.train_from_iterator(CORPUS, trainer)
    tok.save(str(path))


@pytest.mark.parametrize("truncate", [False, True])
@pytest.mark.parametrize("train", [wordpiece, byte_level_bpe, sentencepiece_unigram])
def test_a_text_that_fits_gets_the_ids_it_gets_whole(tmp_path: Path, truncate: bool, train: Any) -> None:
    """Random texts of words, punctuation, added tokens' names, combining accents, runs of spaces and words too long
    for WordPiece, most of them past where their head is first cut: each row's ids are the whole text's (cut to
    max_length with truncate), and a text is refused exactly when its whole is longer than max_length."""
    train(tmp_path / "tokenizer.json")
    manifest = Manifest(
        name="texty",
        architecture="transformer_classifier",
        arch_kwargs={},
        inputs=[TensorSpec(name="tokens", datatype=DataType.INT64, shape=[-1], max_length=MAX, truncate=truncate)],
        outputs=[TensorSpec(name="logits", shape=[3])],
        text=TextInput(input="text", feeds="tokens"),
    )
    encoder = text.encoder_at(tmp_path / "tokenizer.json", manifest)
    rng = random.Random(0)
    first_head = (MAX + 2) * text._reach(encoder.tokenizer)[0]
    past_the_head = 0
    for _ in range(400):
        sample = random_text(rng)
        past_the_head += len(sample) > first_head
        whole = encoder.tokenizer.encode(sample).ids
        if not whole:
            continue
        if len(whole) > MAX and not truncate:
            with pytest.raises(text.TextError, match="longer than its max_length"):
                encoder.encode([sample], "inputs")
            continue
        got = encoder.encode([sample], "inputs")
        assert got["tokens"][0].tolist() == whole[:MAX], sample
    assert past_the_head > 100  # most texts were tokenized by their head first


async def test_past_the_tokenizer_queue_a_text_request_is_a_503_with_retry_after(
    tmp_path: Path, recording: dict[str, Recording], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(text, "TOKENIZER_QUEUE", 1)
    admitted = text.TOKENIZER_THREADS + 1
    async with serving(Settings(store=save_texty(tmp_path), precision="fp32")) as client:
        held = [
            asyncio.create_task(client.post("/predict", json={"inputs": [f"hold the text {i}"]}))
            for i in range(admitted)
        ]
        await until(lambda: text._turns.count == admitted, "the held requests to be admitted to the tokenizer")
        for path, body in [
            ("/predict", {"inputs": ["one too many"]}),
            (
                "/v2/models/texty/infer",
                {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": ["x"]}]},
            ),
        ]:
            refused = await client.post(path, json=body)
            assert refused.status_code == 503, refused.text
            assert refused.headers["retry-after"] == "1"
            assert "retry shortly" in refused.json()["error"]
        assert (await client.get("/health")).status_code == 200
        recording["tokenizer"].release.set()
        for answer in await asyncio.gather(*held):
            assert answer.status_code == 200, answer.text
        after = await client.post("/predict", json={"inputs": ["a short text"]})
        assert after.status_code == 200, after.text


async def test_a_flood_from_one_address_delays_another_by_one_request_per_thread_at_most() -> None:
    """The tokenizing threads are handed out in turn per client address: a request from a second address goes next
    after those already running, not behind every request the first address queued (which it did in arrival order)."""
    started: list[str] = []
    gates: dict[str, threading.Event] = {}

    def work(name: str) -> str:
        started.append(name)
        gates[name].wait(DEADLINE_S)
        return name

    async def request(who: str, name: str) -> str:
        gates[name] = threading.Event()
        return await text.run_in_turn(who, functools.partial(work, name))

    flood = [asyncio.ensure_future(request("flood", f"flood-{i}")) for i in range(6)]
    await until(lambda: len(started) == text.TOKENIZER_THREADS, "the first requests to start")
    other = asyncio.ensure_future(request("other", "other"))
    await asyncio.sleep(0)
    ended = 0
    try:
        while "other" not in started:
            gates[started[ended]].set()  # the oldest running one ends: its thread goes to the next in turn
            ended += 1
            expected = text.TOKENIZER_THREADS + ended
            await until(lambda n=expected: len(started) == n, "the next request to start")
    finally:
        for gate in gates.values():
            gate.set()
        await asyncio.wait_for(asyncio.gather(*flood, other), DEADLINE_S)
    # In turn: at most one more of the flood's (whose turn came first) before it, where arrival order put it last.
    assert started.index("other") <= text.TOKENIZER_THREADS + 1, started
    assert text._turns.count == 0
    assert text._turns.busy == 0


async def test_a_call_its_caller_stopped_waiting_for_holds_its_thread_until_it_returns() -> None:
    """A request cut off by its deadline while its text is tokenized leaves the call running: its thread stays busy,
    and the request counted against the queue, until the call returns, so the turns and the queue's 503 go on
    counting what the threads hold (a cut-off had handed the thread on at once, to wait in the executor's queue)."""
    gates = [threading.Event() for _ in range(text.TOKENIZER_THREADS)]
    calls = [
        asyncio.ensure_future(text.run_in_turn(f"client-{i}", functools.partial(gate.wait, DEADLINE_S)))
        for i, gate in enumerate(gates)
    ]
    await until(lambda: text._turns.busy == text.TOKENIZER_THREADS, "every thread to be taken")
    calls[0].cancel()  # as asyncio.wait_for cancels it at a deadline
    with contextlib.suppress(asyncio.CancelledError):
        await calls[0]
    assert (text._turns.busy, text._turns.count) == (text.TOKENIZER_THREADS, text.TOKENIZER_THREADS)
    waiting = asyncio.ensure_future(text.run_in_turn("next", lambda: "ran"))
    await asyncio.sleep(0.05)
    assert not waiting.done()  # no thread is free: it waits for its turn, not in the executor's hidden queue
    gates[0].set()  # the cut-off call returns: its thread goes to the next in turn
    assert await asyncio.wait_for(waiting, DEADLINE_S) == "ran"
    for gate in gates:
        gate.set()
    await asyncio.wait_for(asyncio.gather(*calls[1:]), DEADLINE_S)
    await until(lambda: (text._turns.busy, text._turns.count) == (0, 0), "every thread to be given back")


async def test_a_request_s_deadline_bounds_its_wait_for_the_tokenizing_threads(
    tmp_path: Path, recording: dict[str, Recording]
) -> None:
    """Every tokenizing thread is held: a request with a deadline is answered 504 when it passes, not once a thread
    frees; the held requests and the next ones are served."""
    async with serving(Settings(store=save_texty(tmp_path), precision="fp32")) as client:
        held = [
            asyncio.create_task(client.post("/predict", json={"inputs": [f"hold the text {i}"]}))
            for i in range(text.TOKENIZER_THREADS)
        ]
        await until(lambda: text._turns.count == text.TOKENIZER_THREADS, "the held requests to take every thread")
        late = [
            client.post("/predict", json={"inputs": ["in time?"]}, headers={"X-Request-Timeout-Ms": "200"}),
            client.post(
                "/v2/models/texty/infer",
                json={
                    "parameters": {"timeout": 200_000},
                    "inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": ["in time?"]}],
                },
            ),
        ]
        for refused in await asyncio.gather(*late):
            assert refused.status_code == 504, refused.text
            assert "deadline passed while the request waited to be decoded" in refused.text
        recording["tokenizer"].release.set()
        for answer in await asyncio.gather(*held):
            assert answer.status_code == 200, answer.text
        timely = await client.post(
            "/predict", json={"inputs": ["a short text"]}, headers={"X-Request-Timeout-Ms": "60000"}
        )
        assert timely.status_code == 200, timely.text
