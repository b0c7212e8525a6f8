"""The model store's folders and files, apart from what a manifest means; torch-free.

Layout::

    <store>/<name>/config.json          the manifest (its meaning: :mod:`halfserve.manifest`)
    <store>/<name>/<version>/           numbered version folders, plain numbers only
    <store>/<name>/.import-<pid>-<...>/ an import's staging folder, a version once complete

The store reads regular files only, JSON ones capped in size, and hands libraries that open files by name a path to
the file it checked. Checkpoints, architectures and weights are :mod:`halfserve.store`'s.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import stat
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

MANIFEST = "config.json"
WEIGHTS = "model.safetensors"
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
_NAME_RE = re.compile(NAME_PATTERN)
MAX_JSON_BYTES = 4 * 1024 * 1024
"""The largest manifest (or other JSON file of a model folder) the store reads. Checked before reading: parsing JSON
takes several times its size in memory (a 340 MB manifest took 1.46 GB), so a huge file fails its model, named."""
MAX_VERSION_DIGITS = 9
_VERSION_NAME = re.compile(rf"[1-9][0-9]{{0,{MAX_VERSION_DIGITS - 1}}}")
"""A version folder's name: the number as ``str(int)`` writes it. ``isdigit()`` alone takes ``²`` (which ``int()``
refuses) and ``07`` (which ``str(7)`` never names); dot-prefixed folders (an import being written) never match."""
_TOO_LONG_VERSION = re.compile(rf"[1-9][0-9]{{{MAX_VERSION_DIGITS},}}")
"""A folder named as a version too large to be one (more than :data:`MAX_VERSION_DIGITS` digits): logged, not read."""


class StoreError(Exception):
    """A model store, manifest or checkpoint is missing or invalid; the message names the file and field."""


class ReportedError(StoreError):
    """A load's failure that another process reported in its own words (an instance process that failed to start:
    ``RuntimeError: ...``), which name the error's type already."""


def check_name(name: str) -> str:
    """Reject model names that could escape the store directory."""
    # fullmatch: with match, "$" would let a trailing newline through.
    if not _NAME_RE.fullmatch(name):
        raise StoreError(f"model name {name!r} is invalid: use letters, digits, '_', '.', '-' (max 64)")
    return name


def model_names(root: Path) -> list[str]:
    """Names of the models in the store (folders holding a manifest)."""
    if not root.is_dir():
        raise StoreError(f"{root}: model store folder does not exist")
    return [name for name in model_folders(root) if _NAME_RE.fullmatch(name)]


def model_folders(root: Path) -> list[str]:
    """Names of the store's folders holding a manifest entry of any kind, named validly or not, hidden ones (an
    import's staging, ``.git``) aside: what the server tries to serve, so that a manifest that is no regular file or a
    folder that is no valid name is refused with a log line rather than passed over in silence."""
    if not root.is_dir():
        raise StoreError(f"{root}: model store folder does not exist")
    return sorted(
        p.name for p in root.iterdir() if not p.name.startswith(".") and os.path.lexists(p / MANIFEST) and p.is_dir()
    )


def model_folder_holding(root: Path, path: Path, importing: str | None = None) -> Path | None:
    """The model folder of the store ``root`` that ``path`` is or lies in (both resolved), or None: a folder of the
    store's holding a manifest entry of any kind (as :func:`model_folders` counts one), or ``importing``'s, the model
    an import is about to write."""
    where, store = path.resolve(), root.resolve()
    if where == store or not where.is_relative_to(store):
        return None
    top = store / where.relative_to(store).parts[0]
    return top if top.name == importing or os.path.lexists(top / MANIFEST) else None


def read_json(path: Path) -> Any:
    """The JSON value of a model folder's file ``path``, at most :data:`MAX_JSON_BYTES` long; a file that is too large,
    unreadable, not JSON or nested too deeply for the parser is a :class:`StoreError` naming it. Raises
    ``FileNotFoundError`` when there is no such file."""
    size = regular_file(path).st_size
    if size > MAX_JSON_BYTES:
        raise StoreError(f"{path}: {size} bytes, over the {MAX_JSON_BYTES}-byte limit on a model folder's JSON files")
    try:
        with opened_regular(path) as fd, os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(MAX_JSON_BYTES + 1)  # bounded again: the file may have grown since its size was read
    except (FileNotFoundError, StoreError):
        raise
    except OSError as e:
        raise StoreError(f"{path}: cannot be read ({e.strerror or e})") from None
    if len(data) > MAX_JSON_BYTES:
        raise StoreError(f"{path}: over the {MAX_JSON_BYTES}-byte limit on a model folder's JSON files")
    try:
        return json.loads(data)
    except ValueError as e:  # JSONDecodeError, or bytes that are not text
        raise StoreError(f"{path}: not valid JSON ({e})") from None
    except RecursionError:
        raise StoreError(f"{path}: not valid JSON (nested too deeply)") from None


def regular_file(path: Path) -> os.stat_result:
    """``path``'s status when it is a regular file (or a link to one); a named pipe, device, socket or folder where
    the store expects a file is a :class:`StoreError`: opening or reading one can block for ever or never end. Raises
    ``FileNotFoundError`` when there is no such file."""
    status = path.stat()
    if not stat.S_ISREG(status.st_mode):
        raise StoreError(f"{path}: not a regular file")
    return status


@contextmanager
def opened_regular(path: Path) -> Iterator[int]:
    """A read-only descriptor of ``path``, checked to be a regular file once open: opened without blocking, so a
    named pipe put in its place after :func:`regular_file` looked cannot hang the opener. Raises as that does."""
    regular_file(path)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise StoreError(f"{path}: not a regular file")
        os.set_blocking(fd, True)  # a regular file never blocks; reads through it behave as plain ones
        yield fd
    finally:
        os.close(fd)


@contextmanager
def readable_path(path: Path) -> Iterator[str]:
    """A path that names the regular file ``path`` named when opened (:func:`opened_regular`), for libraries that
    open files by name themselves (safetensors, tokenizers): on Linux the open descriptor's ``/proc`` entry, so the
    file they open is the one checked; elsewhere ``path`` itself, checked just before."""
    with opened_regular(path) as fd:
        proc = f"/proc/self/fd/{fd}"
        yield proc if os.path.exists(proc) else str(path)


def versions(model_dir: Path) -> list[int]:
    """Version numbers present under ``model_dir``, ascending (folders named as :data:`_VERSION_NAME` says). A folder
    named by more digits than a version may have is left out with a log line: it looks meant as a version."""
    found = []
    for p in model_dir.iterdir():
        if _VERSION_NAME.fullmatch(p.name) and p.is_dir():
            found.append(int(p.name))
        elif _TOO_LONG_VERSION.fullmatch(p.name) and p.is_dir():
            log.warning(
                "model %r: version folder %r is ignored: a version number has at most %d digits",
                model_dir.name,
                p.name,
                MAX_VERSION_DIGITS,
            )
    return sorted(found)


def next_version(model_dir: Path) -> int:
    """The number a new version in ``model_dir`` takes: past every name there that reads as a version, a folder or
    not (a stray file named ``2`` would make the version folder ``2`` impossible to create). Past
    :data:`MAX_VERSION_DIGITS` digits, which the server would not read as a version, a :class:`StoreError`."""
    taken = [int(p.name) for p in model_dir.iterdir() if _VERSION_NAME.fullmatch(p.name)] if model_dir.is_dir() else []
    number = max(taken, default=0) + 1
    if len(str(number)) > MAX_VERSION_DIGITS:
        raise StoreError(
            f"{model_dir}: {number - 1} is the highest number a version may have ({MAX_VERSION_DIGITS} digits): "
            "no new version can be numbered; move the highest away"
        )
    return number


def stored_versions(root: Path, name: str) -> list[int] | None:
    """The versions the store ``root`` holds of model ``name``, ascending; ``None`` when it holds no such model (no
    manifest file). Raises :class:`StoreError` for an invalid name."""
    model_dir = root / check_name(name)
    if not (model_dir / MANIFEST).is_file():
        return None
    return versions(model_dir)


def resolve_version(model_dir: Path, pinned: int | None) -> int:
    """The version to serve: ``pinned`` (the caller's, else the manifest's pin), else the highest present."""
    present = versions(model_dir)
    if pinned is not None:
        if pinned not in present:
            raise StoreError(f"{model_dir / MANIFEST}: version: {pinned} is pinned but not present (have {present})")
        return pinned
    if not present:
        raise StoreError(f"{model_dir}: no numbered version folder holds a checkpoint")
    return present[-1]


def created_mode(full: int = 0o666) -> int:
    """The mode a plain ``open``/``mkdir`` would give a new file (``full`` 0o666) or folder (0o777) under this
    process's umask: what the store's files get though written as owner-only temporary files, so a server running as
    another user (a container's) can read a store built by one."""
    umask = os.umask(0)
    os.umask(umask)
    return full & ~umask


STAGE_PREFIX = ".import-"
"""How the folder an import writes its version into is named: ``.import-<pid>-<random>`` beside the version folders.
The store's version scan never takes it (:func:`halfserve.storage.versions`); it becomes the next numbered version
only once complete, by one rename, so the server never sees a version half written."""


@dataclass(frozen=True)
class Stage:
    """The folder an import writes its version into, in the model's folder (so the rename stays on one file system)."""

    path: Path
    created_model_dir: bool

    @classmethod
    def open(cls, model_dir: Path) -> Stage:
        """A new stage in ``model_dir`` (created if need be), after removing what killed imports left there."""
        created = not model_dir.exists()
        model_dir.mkdir(parents=True, exist_ok=True)
        for leftover in model_dir.glob(STAGE_PREFIX + "*"):
            if not _writer_alive(leftover.name):
                shutil.rmtree(leftover, ignore_errors=True)
        return cls(Path(tempfile.mkdtemp(dir=model_dir, prefix=f"{STAGE_PREFIX}{os.getpid()}-")), created)

    def install(self) -> Path:
        """Rename the stage to the model's next version number; returns the version folder."""
        model_dir = self.path.parent
        self.path.chmod(created_mode(0o777))  # mkdtemp makes it owner-only; a version folder is as others are
        while True:
            vdir = model_dir / str(next_version(model_dir))
            try:
                self.path.rename(vdir)
            except OSError:
                if not os.path.lexists(vdir):
                    raise
                continue  # another import took that number meanwhile: the next is higher
            return vdir

    def discard(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        if self.created_model_dir:
            with contextlib.suppress(OSError):  # not empty: another import wrote there meanwhile
                self.path.parent.rmdir()


def _writer_alive(stage_name: str) -> bool:
    """Whether the import that named a stage ``.import-<pid>-...`` may still be writing it: its process exists."""
    pid = stage_name.removeprefix(STAGE_PREFIX).partition("-")[0]
    if not pid.isascii() or not pid.isdigit():
        return False
    if int(pid) == os.getpid():
        return True  # this process's own: another import running beside this one (its failures discard their own)
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists, owned by another user
        return True
    return True
