"""What a precision record (:mod:`halfserve.precision_record`) and an AOTInductor package in the compile cache
(:mod:`halfserve.compilecache`) know of what builds their model, the code and the version's files, so that one made
before either changed is not trusted.

The operator's code (a ``module:factory`` from a ``--code-path`` folder or an installed ``halfserve.architectures``
entry point, or a name such code registers) is read, not trusted by name: the digest covers every ``.py`` file of the
factory module's top-level package (its folders, recursively), or, for a module that is a single file in a
``--code-path`` folder, every ``.py`` file beside it (the helpers it may import), else the file alone. That is at
most :data:`MAX_FILES` files and :data:`MAX_BYTES` bytes, read once per load; past either, the code is not digested
and no record of it is trusted (every load measures). halfserve's own models are covered by the record's halfserve
version, and the libraries' builders (``torchvision:``, ``transformers:``) by the library's version.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import sys
from pathlib import Path

from halfserve import models
from halfserve.manifest import Manifest

MAX_FILES = 256
"""The most source files a digest reads: a package's own, not a checkout with its tools and vendored libraries."""
MAX_BYTES = 8 * 1024 * 1024
"""The most source bytes a digest reads (about 20 ms of sha256 on one core)."""
OWN = "halfserve"
"""The digest of halfserve's own models: the record's ``halfserve`` version covers their code."""
_SKIPPED = ("__pycache__",)
RECORD = "precision.json"
"""A version's precision record, which holds its files' digest, so is not part of it."""
_CHUNK = 1 << 20
_IDENTITY_FIELDS = ("architecture", "arch_kwargs", "inputs", "outputs")
"""The manifest fields that change what a version computes (its bar and precision are compared on their own)."""


def files_digest(version_dir: Path, manifest: Manifest) -> str:
    """sha256 over the version folder's files (names and contents, the record and temporary files aside) and the
    manifest's fields that change what the version computes."""
    h = hashlib.sha256(json.dumps(manifest.model_dump(mode="json", include=set(_IDENTITY_FIELDS))).encode())
    for file in sorted(version_dir.iterdir()):
        if file.name == RECORD or file.name.startswith(".") or not file.is_file():
            continue
        h.update(f"\0{file.name}\0".encode())
        with file.open("rb") as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
    return h.hexdigest()


class TooMuchCode(Exception):
    """The code to digest is past :data:`MAX_FILES` or :data:`MAX_BYTES`."""


def of(architecture: str) -> str | None:
    """What ``architecture``'s code is, as a record compares it (``sha256:...``, ``torchvision 0.28.0``,
    :data:`OWN`); ``None`` where it cannot be told cheaply (too much code, a factory of no module's): a record
    holding ``None`` is never trusted. The architecture is resolved as a load builds it (already imported there)."""
    for library in (models.TORCHVISION, models.TRANSFORMERS):
        if architecture.startswith(library):
            package = library.rstrip(":")
            try:
                return f"{package} {importlib.metadata.version(package)}"
            except importlib.metadata.PackageNotFoundError:
                return None
    module_name = getattr(models.resolve(architecture), "__module__", None)
    if not isinstance(module_name, str):
        return None
    if module_name == OWN or module_name.startswith(OWN + "."):
        return OWN
    try:
        return _digest(_sources(module_name))
    except (TooMuchCode, OSError):
        return None


def _sources(module_name: str) -> list[tuple[str, Path]]:
    """The source files a digest of ``module_name``'s code reads, each with the name it is digested under (its path
    below its package's folder, so that a copy of the code elsewhere digests the same)."""
    top = sys.modules.get(module_name.split(".")[0])
    if top is None:
        return []
    folders = [Path(p) for p in getattr(top, "__path__", [])]
    if folders:  # a package (a namespace package may span several folders)
        return sorted(f for folder in folders for f in _walk(folder, folder))
    origin = getattr(top, "__file__", None)
    if origin is None:
        return []
    file = Path(origin)
    try:
        in_code_path = models.check_source(top.__name__, top.__name__) is models.Source.CODE_PATH
    except models.UnknownArchitectureError:
        in_code_path = False
    return sorted(_walk(file.parent, file.parent, recursive=False)) if in_code_path else [(file.name, file)]


def _walk(folder: Path, root: Path, recursive: bool = True) -> list[tuple[str, Path]]:
    found: list[tuple[str, Path]] = []
    seen = 0
    for where, dirs, files in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if recursive and not d.startswith(".") and d not in _SKIPPED)
        seen += len(files) + len(dirs)
        if seen > MAX_FILES * 16:  # a folder of everything but code is not walked to its end either
            raise TooMuchCode(folder)
        for name in files:
            if name.endswith(".py"):
                path = Path(where) / name
                found.append((path.relative_to(root).as_posix(), path))
        if len(found) > MAX_FILES:
            raise TooMuchCode(folder)
    return found


def _digest(sources: list[tuple[str, Path]]) -> str | None:
    if not sources:
        return None
    h = hashlib.sha256()
    total = 0
    for name, path in sources:
        data = path.read_bytes()
        total += len(data)
        if total > MAX_BYTES:
            raise TooMuchCode(path)
        h.update(f"\0{name}\0{len(data)}\0".encode())
        h.update(data)
    return f"sha256:{h.hexdigest()}"
