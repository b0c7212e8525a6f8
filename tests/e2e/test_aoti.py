"""``compile: aoti`` through real servers, each start a process of its own: a cold start exports and compiles an
AOTInductor package into the compile cache, a second start loads it and compiles nothing (in instance threads and in
instance processes), an altered package is rebuilt, never loaded, and a package of other weights is never served."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from halfserve import models, store
from halfserve.compilecache import DIGEST_SUFFIX, CompileCache
from halfserve.execution import Batching, Execution
from tests.conftest import needs_cxx, save_tiny_mlp
from tests.e2e.test_compile_cache import ROWS, Start, copied, entries, serve_once
from tests.flipping import flipped

pytestmark = [pytest.mark.slow, needs_cxx]

BF16 = ("--precision", "bf16", "--fidelity-bar", "off")


@pytest.fixture(scope="module")
def first(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Start]:
    """The tiny MLP (two instances) compiled with ``aoti`` for batches up to 2, served once in bf16 with an empty
    compile cache: the store, the cache it filled, and that start."""
    root = tmp_path_factory.mktemp("aoti")
    store_path = root / "store"
    save_tiny_mlp(store_path, execution=Execution(compile="aoti", instances=2), batching=Batching(max_batch_size=2))
    cache = root / "cache"
    return store_path, cache, serve_once(store_path, cache, root / "first", *BF16)


def eager_fp32(store_path: Path) -> np.ndarray:
    """The answers :func:`serve_once` gets, from the checkpoint's module run eagerly in fp32 in this process."""
    module = store.load(store_path, "tiny").module.eval()
    with torch.inference_mode():
        rows = [module(torch.from_numpy(ROWS[i : i + 1])) for i in range(3)] + [module(torch.from_numpy(ROWS[:2]))]
    return torch.cat(rows).numpy()


def test_a_cold_start_compiles_a_package_that_answers_as_eager_does(first: tuple[Path, Path, Start]) -> None:
    store_path, cache, start = first
    assert start.execution["aoti"] is True
    assert start.execution["inductor"] is False
    assert start.execution["compile_cache"] == "miss"
    assert start.execution["compiled_graphs"] == 1  # one package, its batch dimension dynamic
    assert start.execution["inductor_compile_seconds"] > 0
    (entry,) = entries(cache)
    assert entry.with_suffix(DIGEST_SUFFIX).exists()
    assert CompileCache(cache).read(entry.stem)
    reference = eager_fp32(store_path)
    assert not np.array_equal(start.answers, reference)  # bf16, not fp32: the package holds the precision's casts
    np.testing.assert_allclose(start.answers, reference, atol=0.02 * np.abs(reference).max(), rtol=0)


@pytest.mark.parametrize(
    ("placement", "warmup"),
    [("instance_threads", "--warmup"), ("instance_processes", "--warmup"), ("instance_threads", "--no-warmup")],
)
def test_a_second_start_loads_the_package_and_compiles_nothing(
    first: tuple[Path, Path, Start], tmp_path: Path, placement: str, warmup: str
) -> None:
    """In instance threads, in instance processes, and at the first batch where nothing warms up."""
    store_path, cache, start = first
    mine = copied(cache, tmp_path)
    again = serve_once(store_path, mine, tmp_path / "second", *BF16, "--placement", placement, warmup)
    assert again.execution["placement"] == placement
    assert again.execution["compile_cache"] == "hit"
    assert again.execution["compiled_graphs"] == 0
    assert again.execution["cached_graphs"] == 1
    assert again.execution["inductor_compile_seconds"] == 0
    assert again.execution["compile_cache_load_seconds"] > 0
    assert "compiled with AOTInductor" not in again.log
    np.testing.assert_array_equal(again.answers, start.answers)


def test_an_altered_package_is_rebuilt_with_a_warning(first: tuple[Path, Path, Start], tmp_path: Path) -> None:
    store_path, cache, start = first
    mine = copied(cache, tmp_path)
    (entry,) = entries(mine)
    flipped(entry)  # inside the shared library: torch would load it without a word
    again = serve_once(store_path, mine, tmp_path / "rebuilt", *BF16)
    assert again.execution["compile_cache"] == "corrupt"
    assert again.execution["compiled_graphs"] == 1
    assert again.log.count("rebuilt, not used") == 1
    assert "WARNING" in next(line for line in again.log.splitlines() if "rebuilt, not used" in line)
    np.testing.assert_array_equal(again.answers, start.answers)
    assert CompileCache(mine).read(entry.stem)  # written again, whole


def test_weights_rewritten_under_the_same_version_build_a_new_package(
    first: tuple[Path, Path, Start], tmp_path: Path
) -> None:
    """A package holds the weights: the same name, version and architecture with other weights finds no entry."""
    store_path, cache, _ = first
    mine, rewritten = copied(cache, tmp_path), tmp_path / "store"
    shutil.copytree(store_path, rewritten)
    torch.manual_seed(1)
    module = models.build("mlp", in_features=16, hidden=[32], out_features=4)
    store.write_weights(rewritten / "tiny" / "1", module, {"name": "tiny"})
    again = serve_once(rewritten, mine, tmp_path / "rewritten", *BF16)
    assert again.execution["compile_cache"] == "miss"
    assert again.execution["compiled_graphs"] == 1
    reference = eager_fp32(rewritten)
    np.testing.assert_allclose(again.answers, reference, atol=0.02 * np.abs(reference).max(), rtol=0)
    assert len(entries(mine)) == 2  # the first weights' package kept beside this one
