"""The compile cache round trip through real servers: each start is a process of its own, with torch's own on-disk
cache (``TORCHINDUCTOR_CACHE_DIR``) empty, so a graph found at warm-up can only have come from the compile cache's
entry, and a miss cannot hide in a cache of the process."""

from __future__ import annotations

import functools
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from halfserve.compilecache import DIGEST_SUFFIX, ENTRY_SUFFIX, CompileCache
from halfserve.execution import Batching, Execution
from tests.conftest import needs_cxx, save_tiny_mlp, start_server
from tests.flipping import flipped

pytestmark = [pytest.mark.slow, needs_cxx]

ROWS = np.random.default_rng(0).standard_normal((3, 16)).astype(np.float32)


@dataclass
class Start:
    """One server start's answers (each row alone, then all three: batches of 1 and 2 buckets, 2 padded) and its
    ``/models`` execution entry; ``log`` its output."""

    answers: np.ndarray
    execution: dict[str, Any]
    log: str


def serve_once(store: Path, cache: Path, run: Path, *args: str) -> Start:
    run.mkdir()
    env = {"TORCHINDUCTOR_CACHE_DIR": str(run / "torchinductor")}
    # No --threads: on a host of several cores the intra-op threads are settled after warm-up (from the suite's made-up
    # forward time), and the buckets compiled again at the count chosen go into the entry beside the first ones.
    server = start_server(store, run / "server.log", "--compile-cache", str(cache), *args, env=env)
    try:
        # Bounded, but long enough for a first batch that loads (or compiles) what --no-warmup left undone.
        post = functools.partial(httpx.post, f"{server.url}/predict", timeout=120)
        rows = [post(json={"inputs": ROWS[i : i + 1].tolist()}) for i in range(3)]
        rows.append(post(json={"inputs": ROWS[:2].tolist()}))
        assert [r.status_code for r in rows] == [200] * 4
        (entry,) = httpx.get(f"{server.url}/models").json()["models"]
    finally:
        server.stop()
    answers = np.concatenate([np.asarray(r.json()["outputs"], dtype=np.float32) for r in rows])
    return Start(answers, entry["execution"], (run / "server.log").read_text())


def entries(cache: Path) -> list[Path]:
    return sorted(cache.glob(f"*{ENTRY_SUFFIX}"))


@pytest.fixture(scope="module")
def first(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Start]:
    """A store with the tiny MLP compiled with ``inductor`` at buckets 1 and 2, served once in fp32 with an empty
    compile cache: the store, the cache it filled, and that start."""
    root = tmp_path_factory.mktemp("compile-cache")
    store = root / "store"
    save_tiny_mlp(store, execution=Execution(compile="inductor"), batching=Batching(max_batch_size=2))
    cache = root / "cache"
    return store, cache, serve_once(store, cache, root / "first", "--precision", "fp32")


def copied(cache: Path, tmp_path: Path) -> Path:
    mine = tmp_path / "cache"
    shutil.copytree(cache, mine)
    return mine


def test_a_first_start_compiles_and_writes_the_entry(first: tuple[Path, Path, Start]) -> None:
    _, cache, start = first
    assert start.execution["compile_cache"] == "miss"
    assert start.execution["compiled_graphs"] >= 2  # one per bucket at least
    (entry,) = entries(cache)
    assert entry.with_suffix(DIGEST_SUFFIX).exists()
    assert CompileCache(cache).read(entry.stem)  # a whole entry that matches its digest


def test_a_second_start_finds_every_graph_and_compiles_none(first: tuple[Path, Path, Start], tmp_path: Path) -> None:
    store, cache, start = first
    again = serve_once(store, copied(cache, tmp_path), tmp_path / "second", "--precision", "fp32")
    assert again.execution["compile_cache"] == "hit"
    assert again.execution["compiled_graphs"] == 0
    assert again.execution["cached_graphs"] == start.execution["compiled_graphs"]
    assert again.execution["compile_cache_load_seconds"] > 0
    np.testing.assert_array_equal(again.answers, start.answers)


def test_a_corrupted_entry_is_rebuilt_with_a_warning(first: tuple[Path, Path, Start], tmp_path: Path) -> None:
    store, cache, start = first
    mine = copied(cache, tmp_path)
    (entry,) = entries(mine)
    flipped(entry)
    again = serve_once(store, mine, tmp_path / "rebuilt", "--precision", "fp32")
    assert again.execution["compile_cache"] == "corrupt"
    assert again.execution["compiled_graphs"] >= 2
    assert again.log.count("rebuilt, not used") == 1
    assert "WARNING" in next(line for line in again.log.splitlines() if "rebuilt, not used" in line)
    np.testing.assert_array_equal(again.answers, start.answers)
    assert CompileCache(mine).read(entry.stem)  # written again, whole: it matches its digest


def test_an_entry_under_another_key_is_not_used(first: tuple[Path, Path, Start], tmp_path: Path) -> None:
    store, cache, start = first
    mine = copied(cache, tmp_path)
    other = serve_once(store, mine, tmp_path / "bf16", "--precision", "bf16", "--fidelity-bar", "off")
    assert other.execution["compile_cache"] == "miss"
    assert other.execution["cached_graphs"] == 0
    assert other.execution["compiled_graphs"] >= 2
    assert len(entries(mine)) == 2  # the fp32 entry kept beside the bf16 one
    np.testing.assert_allclose(other.answers, start.answers, atol=0.05 * np.abs(start.answers).max(), rtol=0)
