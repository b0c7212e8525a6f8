"""``/predict``'s top labels: numpy's ``argmax``, found without releasing the GIL for small outputs."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable

import numpy as np
import pytest

from halfserve.api.http.predict import PYTHON_ARGMAX_VALUES, top_labels

LABELS = [f"c{i}" for i in range(12)]


def argmax_labels(out: np.ndarray, labels: list[str]) -> list[object]:
    top = out.reshape(len(out), -1, out.shape[-1]).argmax(-1) if out.ndim > 2 else out.argmax(-1)
    result: list[object] = np.asarray(labels, dtype=object)[top].tolist()
    return result


@pytest.mark.parametrize(
    "shape",
    [(1, 10), (5, 12), (3, 4, 12), (2, 2, 3, 12), (1, 200), (30, 12)],
    ids=lambda s: "x".join(map(str, s)),
)
@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64, np.int64])
def test_top_labels_are_numpys_argmax(shape: tuple[int, ...], dtype: type) -> None:
    labels = [f"c{i}" for i in range(shape[-1])]
    rng = np.random.default_rng(sum(shape))
    for _ in range(20):
        # Few distinct values, so that rows hold equal maxima: the first one is the label.
        out = rng.integers(-3, 4, shape).astype(dtype)
        assert top_labels(out, labels) == argmax_labels(out, labels)
        out = rng.standard_normal(shape).astype(dtype) if dtype != np.int64 else out
        assert top_labels(out, labels) == argmax_labels(out, labels)


@pytest.mark.parametrize(
    "row",
    [
        [1.0, np.nan, 5.0, np.nan],  # the first NaN, as argmax takes it, not the largest number
        [np.nan, 1.0, 5.0, 0.0],
        [1.0, np.inf, 5.0, np.inf],
        [-np.inf, -np.inf, -np.inf, -np.inf],
        [1.0, -np.inf, np.inf, 2.0],  # infinities of both signs sum to NaN: numpy answers
        [np.nan] * 4,
        [-0.0, 0.0, -1.0, -2.0],
        [3.4e38, 3.4e38, -3.4e38, 1.0],  # a sum past float32's range is still a number
    ],
)
def test_non_finite_rows_pick_what_argmax_picks_and_a_row_holding_nan_none(row: list[float]) -> None:
    labels = LABELS[:4]
    out = np.array([[0.0, 0.0, 0.0, 1.0], row], dtype=np.float32)
    want = argmax_labels(out, labels)
    if np.isnan(out[1]).any():  # argmax names the first NaN's class: a label for no answer
        want[1] = None
    assert top_labels(out, labels) == want
    assert top_labels(out.reshape(1, 2, 4), labels) == [want]


def test_outputs_past_the_python_limit_use_numpy() -> None:
    rows = PYTHON_ARGMAX_VALUES // len(LABELS) + 1
    out = np.random.default_rng(1).standard_normal((rows, len(LABELS))).astype(np.float32)
    assert out.size > PYTHON_ARGMAX_VALUES
    assert top_labels(out, LABELS) == argmax_labels(out, LABELS)


def runs_beside(calls: list[tuple[Callable[[], object], float]]) -> list[int]:
    """Calls each function over and over for up to so many seconds and says, per function, how often a busy second
    thread ran meanwhile (stopping at the first time it ran).

    The second thread starts under a switch interval of a second, so the caller takes the GIL back from it only by
    force, a second later, and keeps it for the next second unless it releases it: in windows adding up to far less
    than that, the count is 0 for code that keeps the GIL throughout. Code that releases it lets the second thread in
    once the system runs that thread, which on a loaded machine may take many releases. The thread stops before
    anything is asserted."""
    ticks = [0]
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            ticks[0] += 1

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1.0)
    thread = threading.Thread(target=spin, daemon=True)
    counts = []
    try:
        thread.start()
        for fn, seconds in calls:
            before = ticks[0]
            end = time.perf_counter() + seconds
            while ticks[0] == before and time.perf_counter() < end:
                fn()
            counts.append(ticks[0] - before)
    finally:
        stop.set()
        thread.join(timeout=5)
        sys.setswitchinterval(interval)
    return counts


def test_small_outputs_keep_the_gil() -> None:
    small = np.random.default_rng(2).standard_normal((1, 10)).astype(np.float32)
    call = (lambda: top_labels(small, LABELS), 0.01)
    *labels, argmax = runs_beside([call, call, call, (lambda: small.argmax(-1), 0.5)])
    # The least of three windows: another thread of the process that had waited out the old interval (or that wakes
    # now and then, like tqdm's monitor) could take the GIL by force once; code that releases it lets the second
    # thread in in every window.
    assert min(labels) == 0
    # The reason: numpy's argmax lets the other thread in, on the same output (the caller then waits a second).
    assert argmax > 0
