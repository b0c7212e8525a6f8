"""Batch formation, pure and separately tested: a queued request (:class:`Pending`), the rows of it a batch takes
(:class:`Chunk`), when a batch is cut (:func:`seconds_until_cut`) and which rows it takes (:func:`cut_batch`), and
a batch regrouped into smaller ones (:func:`split_rows`). No asyncio loop runs here, no torch, no HTTP: the
batcher (:mod:`halfserve.batching`) owns the queue's timers, the runner and the answers."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

import numpy as np

if TYPE_CHECKING:
    from halfserve.manifest import Precision

T = TypeVar("T")


class Result(NamedTuple):
    """A request's output rows and the distinct precisions of the chunks that computed them, in row order.

    A NamedTuple rather than a frozen dataclass: one is built per request, and a tuple builds several times faster.
    """

    data: np.ndarray
    precisions: tuple[Precision, ...] = ()


Finish = Callable[[np.ndarray, "tuple[Precision, ...]"], T]
"""Makes a request's answer from its output rows and their precisions (:class:`Result` unless the caller says)."""


@dataclass(eq=False, slots=True)
class Pending:
    """A queued request: its rows, how many have been cut into batches so far, and its outputs as they arrive."""

    data: np.ndarray
    future: asyncio.Future[Any]
    enqueued: float
    deadline: float | None = None
    finish: Finish[Any] = Result
    group: Hashable = None
    """What requests share a batch with, beyond their rows' shape and dtype (a length bucket)."""
    taken: int = 0
    done_rows: int = 0
    parts: dict[int, tuple[np.ndarray, Precision | None]] | None = None
    """Outputs of the request's chunks by first row, while they arrive (a request that spans batches)."""
    rows: int = field(init=False)
    key: Hashable = field(init=False)
    """What a batch's requests share: their rows' shape and dtype, and their group."""

    def __post_init__(self) -> None:
        # Worked out once here: cutting a batch reads them for every request it takes.
        self.rows = int(self.data.shape[0])
        self.key = (self.data.shape[1:], self.data.dtype.str, self.group)

    @property
    def remaining(self) -> int:
        return self.rows - self.taken


class Chunk(NamedTuple):
    """Rows ``[start, stop)`` of a pending request, as placed into one batch. A NamedTuple: one is built per request
    a batch takes, and a tuple builds several times faster than a frozen dataclass."""

    request: Pending
    start: int
    stop: int

    @property
    def rows(self) -> int:
        return self.stop - self.start

    @property
    def data(self) -> np.ndarray:
        if self.start == 0 and self.stop == self.request.rows:
            return self.request.data
        return self.request.data[self.start : self.stop]


def seconds_until_cut(queued_rows: int, oldest: float, now: float, max_batch_size: int, max_delay: float) -> float:
    """How long to wait before cutting a batch: 0 when full or when the oldest request has waited ``max_delay``."""
    if queued_rows >= max_batch_size:
        return 0.0
    return max(0.0, oldest + max_delay - now)


def cut_batch(queue: deque[Pending], max_batch_size: int, now: float) -> tuple[list[Chunk], list[Pending]]:
    """Take up to ``max_batch_size`` rows from ``queue``, oldest first, of the head request's sample shape.

    Returns the batch's chunks and the requests removed because their deadline passed (partly taken ones too: their
    remaining rows are never run) or their caller went away. Requests of another shape keep their place. Fully
    taken requests leave the queue; a partly taken one stays at its place with ``taken`` advanced.
    """
    chunks: list[Chunk] = []
    dropped: list[Pending] = []
    key: Hashable = None
    room = max_batch_size
    kept: deque[Pending] = deque()
    while queue and room:
        req = queue.popleft()
        if req.future.done() or (req.deadline is not None and now >= req.deadline):
            dropped.append(req)
            continue
        if key is None:
            key = req.key
        elif req.key != key:
            kept.append(req)
            continue
        start = req.taken
        n = min(room, req.rows - start)
        chunks.append(Chunk(req, start, start + n))
        req.taken = start + n
        room -= n
        if req.taken < req.rows:
            kept.append(req)
    kept.extend(queue)
    queue.clear()
    queue.extend(kept)
    return chunks, dropped


def split_rows(chunks: list[Chunk], size: int) -> list[list[Chunk]]:
    """Regroup ``chunks`` into batches of at most ``size`` rows, in order, splitting chunks where a batch fills."""
    batches: list[list[Chunk]] = []
    current: list[Chunk] = []
    room = size
    for chunk in chunks:
        start = chunk.start
        while start < chunk.stop:
            n = min(room, chunk.stop - start)
            current.append(Chunk(chunk.request, start, start + n))
            start += n
            room -= n
            if not room:
                batches.append(current)
                current, room = [], size
    if current:
        batches.append(current)
    return batches
