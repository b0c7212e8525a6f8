"""Text in: a model whose manifest has a ``text`` block takes UTF-8 texts, tokenized where the request is decoded (the
HTTP process, or each front-end) with the version's Hugging Face ``tokenizer.json``, read with the ``tokenizers``
library from local files only (a JSON file: nothing in it runs).

A request's texts become the sequence input's token ids, padded to its longest text, and each row's own length
(``<input>#length``), so a short text in a long text's request is masked as if it came alone.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Sequence
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

    def __init__(self, tokenizer: Any, lock: threading.Lock, manifest: Manifest) -> None:
        assert manifest.text is not None
        self.text = manifest.text
        self.spec = next(t for t in manifest.inputs if t.name == manifest.text.feeds)
        self.tokenizer = tokenizer
        self._lock = lock

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
        with self._lock:  # one tokenizer object, used from the event loop only; the lock keeps it that way
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
def _tokenizer(path: Path, mtime: float) -> tuple[Any, threading.Lock]:
    """The tokenizer in ``path`` (as it was at ``mtime``), with the lock its calls take."""
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
    return tokenizer, threading.Lock()


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
    return Encoder(*_tokenizer(path, mtime), manifest)
