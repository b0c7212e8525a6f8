"""``halfserve serve``'s flags are the server's settings: one name, default and help for each, in Settings."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from halfserve.cli import build_parser
from halfserve.httpprotocol import HttpLimits
from halfserve.manifest import Precision
from halfserve.settings import LogLevel, Settings


def serve_parser() -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    parser: argparse.ArgumentParser = sub.choices["serve"]
    return parser


def given(argv: list[str]) -> dict[str, object]:
    args = build_parser().parse_args(["serve", *argv])
    return {k: v for k, v in vars(args).items() if k in Settings.model_fields and v is not None}


def test_every_setting_is_a_flag_and_every_flag_a_setting() -> None:
    flags = {
        s.removeprefix("--").replace("-", "_")
        for a in serve_parser()._actions
        for s in a.option_strings
        if s.startswith("--") and not s.startswith("--no-") and s != "--help"
    }
    assert flags == set(Settings.model_fields)


def test_flags_parse_into_the_settings_they_name(tmp_path: Path) -> None:
    settings = Settings(
        **given(
            [
                "--max-body-bytes=2048",
                "--header-timeout=2.5",
                "--no-warmup",
                "--grpc",
                "--precision=bf16",
                "--models=a,b",
                f"--code-path={tmp_path}",
                f"--code-path={tmp_path / 'more'}",
                "--log-level=warning",
            ]
        )
    )
    assert (settings.max_body_bytes, settings.header_timeout) == (2048, 2.5)
    assert (settings.warmup, settings.grpc) == (False, True)
    assert settings.precision is Precision.BF16
    assert settings.models == ["a", "b"]
    assert settings.code_path == [tmp_path, tmp_path / "more"]
    assert settings.log_level is LogLevel.WARNING
    assert given([]) == {}  # a flag not given leaves the setting to the environment and its default


@pytest.mark.parametrize("name", ["max_connections", "body_timeout", "port", "log_format"])
def test_a_flags_help_shows_the_settings_own_default(name: str) -> None:
    (action,) = [a for a in serve_parser()._actions if a.dest == name]
    default = Settings.model_fields[name].default
    assert f"(default: {getattr(default, 'value', default)})" in str(action.help)


def test_the_http_limits_defaults_are_the_settings() -> None:
    limits = HttpLimits()
    for name in ("header_timeout", "body_timeout", "max_url_bytes", "max_header_bytes", "max_connections"):
        assert getattr(limits, name) == Settings.model_fields[name].default


def test_an_http_port_that_is_the_grpc_port_is_refused_before_anything_loads() -> None:
    with pytest.raises(ValueError, match=r"grpc_port \(8001\) is also the HTTP port: give --grpc-port"):
        Settings(port=8001, grpc=True)
    assert Settings(port=8001, grpc=False).port == 8001
    assert Settings(port=8001, grpc=True, grpc_port=8011).grpc_port == 8011
    assert Settings(port=0, grpc=True, grpc_port=0).grpc_port == 0  # any free port, each its own: had been refused


def test_a_flags_help_keeps_an_acronym_and_lowers_a_word() -> None:
    helps = {a.dest: str(a.help) for a in serve_parser()._actions}
    assert helps["http_workers"].startswith("HTTP front-end processes")  # had read "hTTP front-end processes"
    assert helps["port"][0].islower()
    assert helps["admin_token_file"].startswith("a file holding")  # "A file": a word, not an acronym


def test_a_flag_whose_help_describes_its_choices_describes_each() -> None:
    # --fidelity-bar's had described default and off, not measure.
    described = 0
    for action in serve_parser()._actions:
        named = re.findall(r"(?:^|; )(\w+): ", str(action.help))
        if action.choices and set(named) & set(action.choices):
            described += 1
            assert sorted(named) == sorted(action.choices), (action.dest, action.help)
    assert described  # the reader found the form: a change of the help's wording cannot empty this check


def test_a_flag_whose_help_names_its_choices_names_each() -> None:
    # --placement's had named every choice but auto, its default.
    named = 0
    for action in serve_parser()._actions:
        text = re.sub(r" \(default: [^)]*\)$", "", str(action.help))  # the default's name alone describes nothing
        said = {str(c) for c in action.choices or () if re.search(rf"\b{re.escape(str(c))}\b", text)}
        if len(said) >= 2:
            named += 1
            assert said == {str(c) for c in action.choices or ()}, (action.dest, action.help)
    assert named >= 2


def test_threads_and_the_instance_batch_timeout_have_bounds() -> None:
    """--threads 100000 had exhausted the host's processes before the server aborted; an instance batch timeout of a
    millisecond had failed every request."""
    with pytest.raises(ValueError, match="less than or equal to 1024"):
        Settings(threads=100_000)
    with pytest.raises(ValueError, match="greater than or equal to 1"):
        Settings(instance_batch_timeout=0.001)
    assert Settings(threads=1024, instance_batch_timeout=1.0).threads == 1024
