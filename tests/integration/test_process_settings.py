"""Process-wide settings take effect when the server starts serving, not when a repository is built (the CLI builds
one only to validate the store before binding its port)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from halfserve.repository import ModelRepository
from halfserve.settings import Settings
from tests.integration.conftest import serving


@pytest.fixture
def python_default_interval() -> Iterator[float]:
    before = sys.getswitchinterval()
    sys.setswitchinterval(0.005)
    yield 0.005
    sys.setswitchinterval(before)


async def test_the_gil_switch_interval_is_set_by_serving_only(tiny_store: Path, python_default_interval: float) -> None:
    settings = Settings(store=tiny_store, gil_switch_interval_ms=1.0)
    ModelRepository(settings).discover()
    assert sys.getswitchinterval() == pytest.approx(python_default_interval)
    async with serving(settings) as client:
        assert (await client.get("/ready")).status_code == 200
        assert sys.getswitchinterval() == pytest.approx(0.001)
