"""The admin token: long enough to matter, kept off command lines where it can be, and not open to guessing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from server.serving import FailedAttempts
from server.settings import Settings
from tests.integration.conftest import serving

TOKEN = "a-long-enough-admin-token"


def test_short_tokens_and_two_sources_are_refused_and_a_file_is_read(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="admin_token: at least 16 characters"):
        Settings(admin_token="change-me")
    secret = tmp_path / "token"
    secret.write_text(TOKEN + "\n")
    read = Settings(admin_token_file=secret)
    assert read.admin_token is not None
    assert read.admin_token.get_secret_value() == TOKEN
    with pytest.raises(ValidationError, match="give one, not both"):
        Settings(admin_token=TOKEN, admin_token_file=secret)
    with pytest.raises(ValidationError, match="admin_token_file: cannot read"):
        Settings(admin_token_file=tmp_path / "missing")
    secret.write_text("short\n")
    with pytest.raises(ValidationError, match="at least 16 characters"):
        Settings(admin_token_file=secret)


def test_the_cli_refuses_a_short_token_before_binding(tiny_store: Path) -> None:
    cmd = [sys.executable, "-m", "server", "serve", "--store", str(tiny_store), "--admin-token", "change-me"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "admin_token: at least 16 characters" in r.stderr


def test_failed_attempts_lock_an_address_out_for_the_window() -> None:
    now = [0.0]
    attempts = FailedAttempts(limit=3, window=60.0, addresses=2, clock=lambda: now[0])
    for _ in range(3):
        assert attempts.retry_after("a") == 0
        attempts.failed("a")
        now[0] += 1
    assert attempts.retry_after("a") == pytest.approx(57.0)  # the first failure, at 0, leaves the window at 60
    assert attempts.retry_after("b") == 0  # others are not locked out
    now[0] = 60.5
    assert attempts.retry_after("a") == 0  # only two failures left in the window
    attempts.failed("b")
    attempts.failed("c")
    assert "a" not in attempts.failures  # the table holds at most 2 addresses: the quietest is forgotten


async def test_ten_wrong_tokens_get_429_even_with_the_right_one_then(tiny_store: Path) -> None:
    async with serving(Settings(store=tiny_store, admin_token=TOKEN)) as client:
        wrong = [
            await client.post("/models/tiny/unload", headers={"Authorization": f"Bearer guess-{i}"}) for i in range(10)
        ]
        locked = await client.post("/models/tiny/unload", headers={"Authorization": f"Bearer {TOKEN}"})
    assert [r.status_code for r in wrong] == [401] * 10
    assert locked.status_code == 429
    assert 0 < int(locked.headers["retry-after"]) <= 60
    assert locked.json()["error"].startswith("too many wrong admin tokens from ")
