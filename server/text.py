"""Text in: a model whose manifest has a ``text`` block takes UTF-8 texts, tokenized where the request is decoded (the
HTTP process, or each front-end) with the version's Hugging Face ``tokenizer.json``, read with the ``tokenizers``
library from local files only (a JSON file: nothing in it runs).

A request's texts become the sequence input's token ids, padded to its longest text, and each row's own length
(``<input>#length``), so a short text in a long text's request is masked as if it came alone.

Tokenizing runs off the event loop, on a few threads of its own (:func:`encode_off_loop`): a request's worth of text
takes the tokenizer a while (seconds for megabytes), during which the loop goes on answering health checks and other
clients, and ``encode_batch`` lets go of the GIL while it works. How much one request may carry is bounded before
it gets there: rows as for any request, each text's bytes by the manifest's ``text.max_bytes``, and all of a
request's texts together by the server's ``max_text_bytes``.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from server.manifest import LENGTH, Manifest, PackError, check_length


class TextError(ValueError):
    """A text the model cannot take (not UTF-8, too long, nothing to tokenize); the message names the field."""


class TokenizerUnavailableError(TextError):
    """The server cannot tokenize at all: the version's tokenizer file is missing or unreadable, or the library is not
    installed. The server's problem, not the request's (a 503, as a missing checkpoint is)."""


class Encoder:
    """One version's tokenizer, bound to the input it feeds (cheap to make: the tokenizer is read once, by
    :func:`encoder`)."""

    def __init__(self, tokenizer: Any, manifest: Manifest) -> None:
        assert manifest.text is not None
        self.text = manifest.text
        self.spec = next(t for t in manifest.inputs if t.name == manifest.text.feeds)
        self.tokenizer = tokenizer

    def encode(self, texts: Sequence[bytes | str], field: str) -> dict[str, np.ndarray]:
        """The token ids of ``texts`` (one per row) and each row's length, as the named inputs the model takes."""
        if not texts:
            raise TextError(f"{field}: no text; send at least one")
        strings: list[str] = []
        for i, t in enumerate(texts):
            raw = t.encode() if isinstance(t, str) else t
            if len(raw) > self.text.max_bytes:
                raise TextError(f"{field}[{i}]: {len(raw)} bytes, more than the {self.text.max_bytes} a text may have")
            try:
                strings.append(raw.decode("utf-8"))
            except UnicodeDecodeError as e:
                raise TextError(f"{field}[{i}]: not UTF-8 ({e.reason} at byte {e.start})") from None
        # One tokenizer object, shared by the tokenizing threads without a lock: its encode_batch only reads it (its
        # padding and truncation are set once, when it is read) and lets go of the GIL, so a long request leaves the
        # model's other text requests to the other threads.
        ids = [e.ids for e in self.tokenizer.encode_batch(strings)]
        lengths = []
        for i, row in enumerate(ids):
            if not row:
                raise TextError(f"{field}[{i}]: the text gives no tokens")
            try:
                lengths.append(check_length(self.spec, len(row), f"{field}[{i}]: input {self.spec.name!r}"))
            except PackError as e:
                raise TextError(str(e)) from None
        width = max(lengths)
        out = np.full((len(ids), width), self.spec.pad, dtype=self.spec.datatype.numpy)
        for i, (row, n) in enumerate(zip(ids, lengths, strict=True)):
            out[i, :n] = row[:n]
        return {self.spec.name: out, self.spec.name + LENGTH: np.asarray(lengths, dtype=np.int32)}


@functools.lru_cache(maxsize=64)
def _tokenizer(path: Path, mtime: float) -> Any:
    """The tokenizer in ``path`` (as it was at ``mtime``)."""
    try:
        from tokenizers import Tokenizer
    except ImportError:  # an optional extra: halfserve[hf]
        raise TokenizerUnavailableError(
            f"{path}: text input needs the tokenizers library (pip install 'halfserve[hf]')"
        ) from None
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as e:  # the Rust library raises its own exception type
        raise TokenizerUnavailableError(f"{path}: cannot read the tokenizer ({e})") from None
    tokenizer.no_padding()
    tokenizer.no_truncation()
    return tokenizer


def encoder(store: Path, name: str, version: int, manifest: Manifest) -> Encoder:
    """The encoder of model ``name`` at ``version`` in ``store``; its tokenizer is read once (again when the file
    changes)."""
    assert manifest.text is not None
    return encoder_at(store / name / str(version) / manifest.text.tokenizer, manifest)


def encoder_at(path: Path, manifest: Manifest) -> Encoder:
    """The encoder of ``manifest``'s text input with the tokenizer file ``path`` (a version's, or the folder
    ``halfserve import`` reads, whose calibration texts are tokenized as requests will be)."""
    try:
        mtime = path.stat().st_mtime
    except FileNotFoundError:
        raise TokenizerUnavailableError(f"{path}: the model's tokenizer is missing") from None
    return Encoder(_tokenizer(path, mtime), manifest)


TOKENIZER_THREADS = 2
"""Threads that tokenize, all models together: requests beyond them wait their turn without holding the event loop
(``encode_batch`` spreads one request over the cores itself)."""

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="halfserve-tokenize")
        return _pool


def _encode(
    store: Path, name: str, version: int, manifest: Manifest, texts: Sequence[bytes | str], field: str
) -> dict[str, np.ndarray]:
    return encoder(store, name, version, manifest).encode(texts, field)


async def encode_off_loop(
    store: Path, name: str, version: int, manifest: Manifest, texts: Sequence[bytes | str], field: str
) -> dict[str, np.ndarray]:
    """:meth:`Encoder.encode` of model ``name``'s version's encoder, run on a tokenizing thread (the tokenizer is read
    there too, the first time); raises what it raises."""
    call = functools.partial(_encode, store, name, version, manifest, texts, field)
    return await asyncio.get_running_loop().run_in_executor(_executor(), call)


def text_bytes(texts: Sequence[bytes | str], limit: int) -> int:
    """The UTF-8 bytes of ``texts`` together, counted until they pass ``limit`` (then that partial count, already
    over it): an ASCII ``str`` counts its length without encoding."""
    total = 0
    for t in texts:
        total += len(t) if isinstance(t, bytes) or t.isascii() else len(t.encode("utf-8", "surrogatepass"))
        if total > limit:
            break
    return total
