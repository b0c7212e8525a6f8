"""torch.compile's limits and cache, reached through torch._dynamo (not public API) with a way out."""

from __future__ import annotations

import logging
import types

import pytest
import torch

from server import compilation


def test_the_recompile_limit_is_raised_to_an_engines_bucket_count(monkeypatch: pytest.MonkeyPatch) -> None:
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    monkeypatch.setattr(config, name, 8)
    assert compilation.allow_compiled_shapes(20)
    assert getattr(config, name) == 20
    assert compilation.allow_compiled_shapes(4)
    assert getattr(config, name) == 20  # never lowered: another engine may need more


def test_a_torch_without_the_limit_or_the_cache_warns_and_goes_on(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(torch._dynamo, "config", types.SimpleNamespace())
    monkeypatch.delattr(torch._dynamo.eval_frame, "remove_from_cache")
    with caplog.at_level(logging.WARNING, logger="server.compilation"):
        assert not compilation.allow_compiled_shapes(20)
        assert not compilation.forget_compiled(test_a_torch_without_the_limit_or_the_cache_warns_and_goes_on.__code__)
    assert [r.levelno for r in caplog.records] == [logging.WARNING, logging.WARNING]
