"""Text in: a model whose manifest has a ``text`` block takes UTF-8 texts, tokenized where the request is decoded (the
HTTP process, or each front-end) with the version's Hugging Face ``tokenizer.json``, read with the ``tokenizers``
library from local files only (a JSON file: nothing in it runs).

A request's texts become the sequence input's token ids, padded to its longest text, and each row's own length
(``<input>#length``), so a short text in a long text's request is masked as if it came alone.

Tokenizing runs off the event loop, on a few threads of its own (:func:`encode_off_loop`): a request's worth of text
takes the tokenizer a while (seconds for megabytes), during which the loop goes on answering health checks and other
clients, and ``encode_batch`` lets go of the GIL while it works. How much one request may carry is bounded before
it gets there: rows as for any request, each text's bytes by the manifest's ``text.max_bytes``, and all of a
request's texts together by the server's ``max_text_bytes``; each text is tokenized no further than its input's
``max_length`` tokens reach, the threads are handed out in turn per client address, and past
:data:`TOKENIZER_QUEUE` waiting requests a request is refused, not queued.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextvars import ContextVar
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from halfserve.manifest import Manifest
from halfserve.packing import LENGTH, PackError, check_length
from halfserve.storage import StoreError, readable_path, regular_file

T = TypeVar("T")


class TextError(ValueError):
    """A text the model cannot take (not UTF-8, too long, nothing to tokenize); the message names the field."""


class TokenizerUnavailableError(TextError):
    """The server cannot tokenize at all: the version's tokenizer file is missing or unreadable, or the library is not
    installed. The server's problem, not the request's (a 503, as a missing checkpoint is)."""


class TokenizerBusyError(TextError):
    """More requests wait to be tokenized than the queue holds (:data:`TOKENIZER_QUEUE`): a 503 with ``Retry-After``,
    as a full batch queue is."""


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
        ids, cut = self._token_ids(strings)
        lengths = []
        for i, row in enumerate(ids):
            if not row:
                raise TextError(f"{field}[{i}]: the text gives no tokens")
            where = f"{field}[{i}]: input {self.spec.name!r}"
            if i in cut and not self.spec.truncate:  # only its first tokens were made: say "more than", not a count
                raise TextError(
                    f"{where}: more than {self.spec.max_length} tokens, longer than its max_length (or set truncate)"
                )
            try:
                lengths.append(check_length(self.spec, len(row), where))
            except PackError as e:
                raise TextError(str(e)) from None
        width = max(lengths)
        out = np.full((len(ids), width), self.spec.pad, dtype=self.spec.datatype.numpy)
        for i, (row, n) in enumerate(zip(ids, lengths, strict=True)):
            out[i, :n] = row[:n]
        return {self.spec.name: out, self.spec.name + LENGTH: np.asarray(lengths, dtype=np.int32)}

    def _token_ids(self, strings: list[str]) -> tuple[list[list[int]], set[int]]:
        """Each string's token ids, and the rows of which only the first ``max_length`` tokens and more were made.

        A text is tokenized no further than ``max_length`` tokens can reach: 16 texts of 65,000 ``!`` took a
        tokenizing thread 1.5 s whole, to be refused for their length afterwards. A long text's head is tokenized
        first, :data:`_REACH` characters per token it may use; its tokens are the whole text's own up to the head's
        last word (a pre-tokenizer splits words by what precedes them, and an added token can only span the head's
        end in its last characters), so once those are more than ``max_length`` the rest cannot change the row's
        first ``max_length`` tokens nor that it is too long. Otherwise the head doubles, up to the whole text: a text
        that fits is always tokenized whole, its ids as they would be without the cut.
        """
        limit = self.spec.max_length
        # One tokenizer object, shared by the tokenizing threads without a lock: its encode_batch only reads it (its
        # padding and truncation are set once, when it is read) and lets go of the GIL, so a long request leaves the
        # model's other text requests to the other threads.
        if limit is None:
            return [e.ids for e in self.tokenizer.encode_batch(strings)], set()
        ids: list[list[int]] = [[] for _ in strings]
        cut: set[int] = set()
        reach, margin = _reach(self.tokenizer)
        head = (limit + 2) * reach + margin
        pending = list(range(len(strings)))
        while pending:
            heads = [strings[i] if len(strings[i]) <= head else strings[i][:head] for i in pending]
            still = []
            for i, piece, enc in zip(pending, heads, self.tokenizer.encode_batch(heads), strict=True):
                if len(piece) == len(strings[i]):
                    ids[i] = enc.ids
                elif (kept := _settled(enc, len(piece) - margin)) > limit:
                    ids[i] = enc.ids[:kept]
                    cut.add(i)
                else:
                    still.append(i)
            pending, head = still, head * 2
        return ids, cut


_REACH = 4
"""Characters per token a text's head is given on top of the longest token: the spaces and characters a normalizer
drops between tokens (the head doubles while it falls short, so this sets the first try, not what is right)."""


@functools.lru_cache(maxsize=64)
def _reach(tokenizer: Any) -> tuple[int, int]:
    """Characters a token may take of a text at first try, and the characters at a head's end whose tokens may
    differ from the whole text's (the longest added token's, plus one for a normalizer joining characters)."""
    longest = max((len(t) for t in tokenizer.get_vocab(with_added_tokens=False)), default=1)
    added = tokenizer.get_added_tokens_decoder().values()
    return longest + _REACH, max((len(t.content) for t in added), default=0) + 1


def _settled(enc: Any, end: int) -> int:
    """How many of a head's first tokens (``enc``) the whole text gives too: those of its words wholly before
    character ``end``, but its last word, which may go on in the text (a token of no word, the post-processor's,
    counts at the start only)."""
    words: list[int | None] = enc.word_ids
    offsets: list[tuple[int, int]] = enc.offsets
    last = max((w for w in words if w is not None), default=None)
    kept = 0
    for i, (word, (_, stop)) in enumerate(zip(words, offsets, strict=True)):
        if word is None and i == kept:
            kept += 1
            continue
        if word is None or word == last or stop > end:
            break
        kept = i + 1
    # The word the count stopped in may go on past the head: none of its tokens is settled.
    while 0 < kept < len(words) and words[kept] is not None and words[kept - 1] == words[kept]:
        kept -= 1
    return kept


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
        with readable_path(path) as readable:
            tokenizer = Tokenizer.from_file(readable)
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
        mtime = regular_file(path).st_mtime
    except FileNotFoundError:
        raise TokenizerUnavailableError(f"{path}: the model's tokenizer is missing") from None
    except StoreError as e:  # not a regular file: reading a named pipe or device would not end
        raise TokenizerUnavailableError(str(e)) from None
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


TOKENIZER_QUEUE = 64
"""Requests of this process that may wait for a tokenizing thread, beyond those being tokenized; one more is refused
(:class:`TokenizerBusyError`) rather than queued behind work no deadline bounds. Each is tokenized no further than
its rows' ``max_length`` tokens reach (:meth:`Encoder.encode`), and they are taken in turn per client address
(:class:`_Turns`), so a client's request waits behind at most one of each other client's."""

CLIENT: ContextVar[str] = ContextVar("halfserve_text_client", default="")
"""The address of the client whose request is being decoded (set where its body is read): whose turn its texts take."""


class _Turns:
    """The tokenizing threads handed out in turn per client address: a thread that comes free goes to the next
    address waiting (round robin), not to the oldest request, so one address's flood of requests delays another's
    by one request each at most. Kept on the event loop, which alone admits."""

    def __init__(self) -> None:
        self.busy = 0
        """Threads handed out."""
        self.waiting: OrderedDict[str, deque[asyncio.Future[None]]] = OrderedDict()
        self.admitted: Counter[str] = Counter()

    @property
    def count(self) -> int:
        return sum(self.admitted.values())

    async def take(self, who: str) -> None:
        """Return once ``who`` holds a thread (call :meth:`give` after)."""
        if self.busy < TOKENIZER_THREADS and not self.waiting:
            self.busy += 1
            return
        turn = asyncio.get_running_loop().create_future()
        self.waiting.setdefault(who, deque()).append(turn)
        try:
            await turn
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():  # handed a thread as it was cancelled: pass it on
                self.give()
            else:
                mine = self.waiting.get(who)
                if mine is not None and turn in mine:
                    mine.remove(turn)
                    if not mine:
                        del self.waiting[who]
            raise

    def give(self) -> None:
        """A thread came free: to the next address waiting, that address then last in line."""
        while self.waiting:
            who, turns = next(iter(self.waiting.items()))
            turn = turns.popleft()
            if turns:
                self.waiting.move_to_end(who)
            else:
                del self.waiting[who]
            if not turn.done():
                turn.set_result(None)
                return
        self.busy -= 1


_turns = _Turns()


async def run_in_turn(who: str, call: Callable[[], T]) -> T:
    """``call()`` on a tokenizing thread once ``who``'s turn comes; :class:`TokenizerBusyError` when the queue is
    full."""
    if _turns.count >= TOKENIZER_THREADS + TOKENIZER_QUEUE:
        raise TokenizerBusyError(f"the server is tokenizing {_turns.count} requests' texts, as many as it holds")
    _turns.admitted[who] += 1
    running = False
    try:
        await _turns.take(who)
        future = asyncio.get_running_loop().run_in_executor(_executor(), call)
        running = True
        # The thread is handed on, and the request stops counting, when the call returns: a caller that stops waiting
        # (its deadline passed, its client gone) leaves it running on a thread that is not free until then.
        future.add_done_callback(lambda done: _returned(who, done))
        return await asyncio.shield(future)
    finally:
        if not running:
            _left(who)


def _returned(who: str, done: asyncio.Future[Any]) -> None:
    if not done.cancelled():
        done.exception()  # retrieved: a caller that stopped waiting never will
    _turns.give()
    _left(who)


def _left(who: str) -> None:
    _turns.admitted[who] -= 1
    if not _turns.admitted[who]:
        del _turns.admitted[who]


async def encode_off_loop(
    store: Path, name: str, version: int, manifest: Manifest, texts: Sequence[bytes | str], field: str
) -> dict[str, np.ndarray]:
    """:meth:`Encoder.encode` of model ``name``'s version's encoder, run on a tokenizing thread in its client's turn
    (the tokenizer is read there too, the first time); raises what it raises, and :class:`TokenizerBusyError` when the
    queue is full."""
    call = functools.partial(_encode, store, name, version, manifest, texts, field)
    try:
        return await run_in_turn(CLIENT.get(), call)
    except TokenizerBusyError as e:
        raise TokenizerBusyError(f"{field}: {e}; retry shortly") from None


def text_bytes(texts: Sequence[bytes | str], limit: int) -> int:
    """The UTF-8 bytes of ``texts`` together, counted until they pass ``limit`` (then that partial count, already
    over it): an ASCII ``str`` counts its length without encoding."""
    total = 0
    for t in texts:
        total += len(t) if isinstance(t, bytes) or t.isascii() else len(t.encode("utf-8", "surrogatepass"))
        if total > limit:
            break
    return total
