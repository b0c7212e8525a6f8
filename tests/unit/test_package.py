"""What ``pip install`` puts into an environment: the one package ``halfserve``, and no top-level ``server`` (the
source root's name, which many projects, and a model's ``--code-path`` code, use for a module of their own)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import halfserve

ROOT = Path(__file__).resolve().parents[2]


def test_the_installed_package_is_halfserve_from_the_source_root_and_there_is_no_server_package(tmp_path: Path) -> None:
    # A fresh interpreter in a folder of its own: only what the installation put on its path can be found.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    probe = "import importlib.util, halfserve; print(halfserve.__file__); print(importlib.util.find_spec('server'))"
    run = subprocess.run(
        [sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    where, server = run.stdout.split("\n")[:2]
    assert Path(where).parent.name == "halfserve"
    assert server == "None"
    assert Path(halfserve.__file__).resolve().parent.name == "halfserve"


@pytest.mark.slow
def test_the_wheel_holds_halfserve_and_its_data_files_only(tmp_path: Path) -> None:
    # What a regular (non-editable) install copies into site-packages, built from what the image's build copies (the
    # Dockerfile's COPY lines), in a folder of its own so that the build leaves nothing in the checkout.
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "server", source / "server", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    pip = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "--disable-pip-version-check"]
    build = subprocess.run([*pip, "-w", str(tmp_path), str(source)], capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stderr
    (wheel,) = tmp_path.glob("halfserve-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    name, version = wheel.name.split("-")[:2]
    assert {n.split("/")[0] for n in names} == {"halfserve", f"{name}-{version}.dist-info"}
    # The package's data: the gRPC protocol's descriptors and the status page.
    assert {"halfserve/protos/descriptors.binpb", "halfserve/api/http/static/status.html"} <= set(names)
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "halfserve = halfserve.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()
