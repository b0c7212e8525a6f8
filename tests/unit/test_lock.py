"""constraints.txt, the lock, covers what pyproject.toml asks for, and the README, .ci/run and the image install
from it. A dependency added to pyproject.toml without re-running scripts/refresh-lock fails here, not on a user's
fresh machine."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - the lock installs tomli on 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
LOCK = ROOT / "constraints.txt"
PYTHONS = ["3.10", "3.11", "3.12", "3.13"]
PLATFORMS = [("linux", "Linux", "x86_64"), ("linux", "Linux", "aarch64"), ("darwin", "Darwin", "arm64")]
ENVIRONMENTS = [
    {
        "python_version": py,
        "python_full_version": f"{py}.0",
        "sys_platform": sys_platform,
        "platform_system": system,
        "platform_machine": machine,
        "implementation_name": "cpython",
        "platform_python_implementation": "CPython",
    }
    for py in PYTHONS
    for sys_platform, system, machine in PLATFORMS
]


def lock_lines(text: str) -> list[Requirement]:
    return [Requirement(line.split("#", 1)[0]) for line in text.splitlines() if line.split("#", 1)[0].strip()]


def pins(environment: dict[str, str]) -> dict[str, list[Version]]:
    """The lock as pip reads it in one environment: its markers evaluated, each package's pinned versions."""
    found: dict[str, list[Version]] = {}
    for req in lock_lines(LOCK.read_text()):
        if req.marker is None or req.marker.evaluate(environment):
            (spec,) = req.specifier
            assert spec.operator == "==", f"{req}: the lock pins exact versions"
            found.setdefault(canonicalize_name(req.name), []).append(Version(spec.version))
    return found


def project_requirements() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    return [Requirement(r) for r in [*project["dependencies"], *extras["train"], *extras["test"], *extras["docs"]]]


@pytest.mark.parametrize("environment", ENVIRONMENTS, ids=lambda e: f"py{e['python_version']}-{e['platform_machine']}")
def test_every_requirement_of_the_project_is_locked_once_at_a_version_it_allows(environment: dict[str, str]) -> None:
    locked = pins(environment)
    assert all(len(versions) == 1 for versions in locked.values()), "two pins for one package in one environment"
    for req in project_requirements():
        if req.marker is not None and not req.marker.evaluate(environment):
            continue
        versions = locked.get(canonicalize_name(req.name))
        assert versions, f"{req.name} is in pyproject.toml but not in the lock: run scripts/refresh-lock"
        assert versions[0] in req.specifier, f"the lock's {req.name}=={versions[0]} is outside pyproject's {req}"


def test_the_lock_pins_a_torch_release_and_none_of_its_cuda_runtime_wheels() -> None:
    """The runtime wheels differ between torch's CPU build, PyPI's CUDA build and PyTorch's cuNNN indexes, and torch
    pins them exactly itself; a lock naming PyPI's would conflict with a GPU host's build."""
    names = [canonicalize_name(r.name) for r in lock_lines(LOCK.read_text())]
    assert "torch" in names
    cuda = [n for n in names if re.match(r"nvidia-|cuda-|triton$", n)]
    assert not cuda


def test_the_readme_installs_from_the_lock_and_its_torch() -> None:
    readme = (ROOT / "README.md").read_text()
    (locked_torch,) = pins(ENVIRONMENTS[0])["torch"]
    installs = [line for line in readme.splitlines() if re.match(r"^pip install ", line)]
    assert len(installs) >= 3, "the serve command, the test command and the GPU host's command"
    for line in installs:
        for step in line.split("&&"):
            if step.strip().startswith("pip install") and "--index-url" not in step:
                assert "-c constraints.txt" in step, f"installs without the lock: {step.strip()}"
    for version in re.findall(r"torch==([\w.]+)", readme):
        assert version == str(locked_torch), f"the README installs torch {version}, the lock has {locked_torch}"


def test_ci_and_the_image_install_from_the_lock() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r'pip install .*-c "\$lock" -e \'\.\[test\]\'', ci)
    assert re.search(r"^python -m pytest$", ci, re.M), ".ci/run calls the README's test command"
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "COPY pyproject.toml README.md constraints.txt ./" in dockerfile
    # The project's install is a step of a RUN (after the optional build secrets are put in place).
    runs = [r for r in re.sub(r"\\\n", " ", dockerfile).splitlines() if r.startswith("RUN ")]
    assert any(re.search(r'(RUN|&&) pip install -c constraints\.txt "\./\[train\]"', r) for r in runs)
    assert "!constraints.txt" in (ROOT / ".dockerignore").read_text().splitlines()


INTERNALS = {"uvicorn": ("uvicorn.protocols", "uvicorn.lifespan", "uvicorn.loops", "uvicorn.supervisors")}
"""Modules of a dependency that are not its public API: code importing them is bound to the releases it was tested
with. (torch's private calls, in server/halfserve/compilation.py, are guarded instead: a GPU host brings its own
torch.)"""


def internal_imports() -> dict[str, set[str]]:
    """Per dependency, the server's modules that import its internals (a module under :data:`INTERNALS`, or one whose
    dotted name has a part starting with an underscore)."""
    import ast

    found: dict[str, set[str]] = {}
    for path in (ROOT / "server" / "halfserve").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [node.module or ""]
                if isinstance(node, ast.ImportFrom) and node.level == 0
                else [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else []
            )
            for name in names:
                root = name.split(".")[0]
                private = any(part.startswith("_") for part in name.split(".")[1:])
                if private or name.startswith(INTERNALS.get(root, ("\0",))):
                    found.setdefault(root, set()).add(str(path.relative_to(ROOT)))
    return found


def test_a_dependency_whose_internals_are_used_has_an_upper_bound_the_lock_is_within() -> None:
    used = internal_imports()
    assert "uvicorn" in used, "server/halfserve/transport.py builds on uvicorn's httptools protocol"
    requirements = {canonicalize_name(r.name): r for r in project_requirements()}
    locked = pins(ENVIRONMENTS[0])
    for package, where in sorted(used.items()):
        req = requirements.get(canonicalize_name(package))
        assert req is not None, f"{sorted(where)} import {package}'s internals, and pyproject.toml does not require it"
        uppers = [s for s in req.specifier if s.operator in {"<", "<=", "==", "~="}]
        assert uppers, f"{sorted(where)} import {package}'s internals: pyproject.toml's {req} needs an upper bound"
        (version,) = locked[canonicalize_name(package)]
        assert version in req.specifier, f"the lock's {package}=={version} is outside {req}"
