"""The admin token: long enough to matter, kept off command lines where it can be, and not open to guessing, without
guessers locking its holders out."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from halfserve.api.access import check_admin
from halfserve.api.errors import APIError
from halfserve.api.lockout import FailedAttempts
from halfserve.regions import Regions
from halfserve.serving import AppState, NoModels
from halfserve.settings import Settings
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


def test_a_token_file_of_two_lines_or_past_its_size_or_not_a_file_is_refused(tmp_path: Path) -> None:
    """A second line had been taken into the token, which no client can send (every call a 401, nothing logged);
    /dev/zero had been read until memory ran out."""
    secret = tmp_path / "token"
    secret.write_text(f"{TOKEN}\nsecond\n")
    with pytest.raises(ValidationError, match="admin_token: printable ASCII without spaces or line breaks"):
        Settings(admin_token_file=secret)
    secret.write_bytes(b"x" * 4097)
    with pytest.raises(ValidationError, match="more than 4096 bytes; expected one line, the token"):
        Settings(admin_token_file=secret)
    with pytest.raises(ValidationError, match="admin_token_file: /dev/zero: not a regular file"):
        Settings(admin_token_file=Path("/dev/zero"))
    with pytest.raises(ValidationError, match="admin_token: printable ASCII"):
        Settings(admin_token=f"{TOKEN} with spaces")
    secret.write_text(f"  {TOKEN}\n")
    assert Settings(admin_token_file=secret).admin_token.get_secret_value() == TOKEN  # type: ignore[union-attr]


def test_a_refused_token_is_not_printed(tiny_store: Path) -> None:
    """A token refused for a trailing space had been printed in the refusal (pydantic's ``input_value``)."""
    token = "a-long-enough-but-secret-token "
    cmd = [sys.executable, "-m", "halfserve", "serve", "--store", str(tiny_store), "--admin-token", token]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "admin_token: printable ASCII without spaces" in r.stderr
    assert "secret" not in r.stderr


def test_the_cli_refuses_a_short_token_before_binding(tiny_store: Path) -> None:
    cmd = [sys.executable, "-m", "halfserve", "serve", "--store", str(tiny_store), "--admin-token", "change-me"]
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


def test_failed_attempts_from_every_address_together_are_bounded_too() -> None:
    now = [0.0]
    attempts = FailedAttempts(limit=10, window=60.0, total=5, clock=lambda: now[0])
    for i in range(5):
        assert attempts.retry_after(f"10.0.0.{i}") == 0
        attempts.failed(f"10.0.0.{i}")
    assert attempts.retry_after("10.0.0.99") == pytest.approx(60.0)  # an address with no failures of its own
    assert attempts.retry_after_all() == pytest.approx(60.0)
    now[0] = 61.0
    assert attempts.retry_after("10.0.0.99") == 0


async def test_wrong_tokens_are_answered_429_but_the_right_one_always_gets_in(tiny_store: Path) -> None:
    """Ten wrong tokens from the operator's own address (a typo, or someone else behind the same address) must not
    lock the operator out: only wrong tokens are answered 429 from then on."""
    async with serving(Settings(store=tiny_store, admin_token=TOKEN)) as client:
        wrong = [
            await client.post("/models/tiny/unload", headers={"Authorization": f"Bearer guess-{i}"}) for i in range(10)
        ]
        still_wrong = await client.post("/models/tiny/unload", headers={"Authorization": "Bearer guess-10"})
        right = await client.post("/models/tiny/unload", headers={"Authorization": f"Bearer {TOKEN}"})
        again = await client.post("/models/tiny/load", headers={"Authorization": f"Bearer {TOKEN}"})
    assert [r.status_code for r in wrong] == [401] * 10
    assert still_wrong.status_code == 429
    assert 0 < int(still_wrong.headers["retry-after"]) <= 60
    assert still_wrong.json()["error"].startswith("too many wrong admin tokens from 127.0.0.1; retry in ")
    assert right.status_code == 200, right.text
    assert again.status_code == 200, again.text


def test_guesses_from_many_addresses_are_bounded_together_and_the_right_token_still_gets_in(tiny_store: Path) -> None:
    """Per-address counts alone let a guesser with many addresses go on at full speed: past 100 wrong tokens a
    minute from every address together, a wrong one from an address never seen is a 429 too."""
    settings = Settings(store=tiny_store, admin_token=TOKEN)
    app = AppState(settings, NoModels(), Regions(settings.max_shm_regions))
    for i in range(100):
        with pytest.raises(APIError) as failed:
            check_admin(app, f"10.0.{i // 256}.{i % 256}", "Bearer guess")
        assert failed.value.status == 401
    with pytest.raises(APIError) as locked:
        check_admin(app, "192.168.7.7", "Bearer guess")
    assert locked.value.status == 429
    assert locked.value.message.startswith("too many wrong admin tokens from every address; retry in ")
    check_admin(app, "192.168.7.7", f"Bearer {TOKEN}")  # accepted: no exception
