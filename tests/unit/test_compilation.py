"""torch.compile's limits and cache, reached through torch._dynamo (not public API) with a way out."""

from __future__ import annotations

import logging
import types

import pytest
import torch

from halfserve import compilation


def test_the_recompile_limit_is_raised_to_an_engines_bucket_count() -> None:
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    before = getattr(config, name)
    try:
        assert compilation.allow_compiled_shapes(before + 12)
        assert getattr(config, name) == before + 12
        assert compilation.allow_compiled_shapes(4)
        assert getattr(config, name) == before + 12  # never lowered: another engine may need more
    finally:
        setattr(config, name, before)


def test_a_torch_without_the_limit_or_the_cache_warns_and_goes_on(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # A torch whose _dynamo has neither (the module's own reference to torch is replaced, not torch's internals).
    bare = types.SimpleNamespace(config=types.SimpleNamespace(), eval_frame=types.SimpleNamespace())
    monkeypatch.setattr(compilation, "torch", types.SimpleNamespace(_dynamo=bare, __version__="9.9"))
    with caplog.at_level(logging.WARNING, logger="halfserve.compilation"):
        assert not compilation.allow_compiled_shapes(20)
        assert not compilation.forget_compiled(test_a_torch_without_the_limit_or_the_cache_warns_and_goes_on.__code__)
    assert [r.levelno for r in caplog.records] == [logging.WARNING, logging.WARNING]
