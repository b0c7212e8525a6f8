"""The code an import copies into the operator's folders (an archive's model file, its handler and the modules beside
it): staged in a hidden folder in each, run from there while the import builds the model, and moved into place only
once the import is accepted, one import into a folder at a time. A refused or failed import leaves every folder as it
was."""

from __future__ import annotations

import fcntl
import os
import shutil
import sys
import tempfile
from pathlib import Path, PurePosixPath

from halfserve.storage import StoreError


class CodeCopies:
    """The archive's code an import copies into the operator's folders (its model file, its handler and the modules
    beside it): first into a hidden folder in each (:data:`STAGING`), which the import runs them from, then moved into
    place once the import is accepted (:meth:`install`). :meth:`discard`, on a refusal or a failure, leaves each
    folder as it was, and removes one the import created: a refused import copies nothing."""

    STAGING = ".halfserve-import-"

    def __init__(self) -> None:
        self._staging: dict[Path, Path] = {}
        """Each code folder (resolved) and its hidden staging folder."""
        self._created: list[Path] = []
        """The folders made for the copies, outermost first: removed again when empty."""
        self._files: list[tuple[Path, Path]] = []
        """Each copy: where it is staged, where it goes."""
        self._held: dict[Path, int] = {}
        """Each code folder this import holds (:meth:`hold`), and the descriptor its lock is on."""

    def hold(self, folder: Path) -> None:
        """Hold ``folder`` (or, where it is still to be made, the nearest folder above it that exists) for this import
        alone until :meth:`discard`: two imports into one code folder run their checks and copies one after the
        other, so neither finds the other's files appearing midway and refuses after its model was written. An
        exclusive ``flock`` on the folder itself: nothing is written there, and a killed import's lock goes with it."""
        where = next(p for p in (folder.resolve(), *folder.resolve().parents) if p.is_dir())
        if where in self._held:
            return
        fd = os.open(where, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"halfserve import: waiting for another import into {where} to finish", file=sys.stderr)
            fcntl.flock(fd, fcntl.LOCK_EX)
        self._held[where] = fd
        if where == folder.resolve():
            # Held, the folder has no import in progress: a staging folder left in it is a killed import's.
            for stale in set(where.glob(f"{self.STAGING}*")) - set(self._staging.values()):
                print(f"halfserve import: removing {stale}, left by an import that did not finish", file=sys.stderr)
                shutil.rmtree(stale, ignore_errors=True)

    @property
    def folders(self) -> list[Path]:
        """The staging folders, for the import path while the import builds the model and its handler."""
        return list(self._staging.values())

    def copy(self, source: Path, folder: Path, name: PurePosixPath) -> None:
        """Stage ``source`` to be ``name`` under the code folder ``folder``."""
        where = folder.resolve()
        if where not in self._staging:
            missing = [p for p in (where, *where.parents) if not p.exists()]
            where.mkdir(parents=True, exist_ok=True)
            self._created += reversed(missing)
            self._staging[where] = Path(tempfile.mkdtemp(prefix=self.STAGING, dir=where))
        staged = self._staging[where].joinpath(*name.parts)
        staged.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, staged)
        self._files.append((staged, where.joinpath(*name.parts)))

    def install(self) -> None:
        """Move the staged copies into place; a file of that name there already is kept (it was checked to be the
        same when staged), and one that appeared since with other content is refused, not written over."""
        for staged, target in self._files:
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                with staged.open("rb") as src, target.open("xb") as dst:
                    shutil.copyfileobj(src, dst)
            except FileExistsError:
                if target.read_bytes() != staged.read_bytes():
                    raise StoreError(f"{target} appeared during the import and differs from the archive's") from None
        self._files.clear()

    def discard(self) -> None:
        """Remove the staging folders, and the folders made for the copies that hold nothing (after :meth:`install`,
        they hold the copies). The modules imported from the staging folders are forgotten, and the folders taken off
        the import path: a process that serves after importing (``cli.main`` called twice) imports them again from
        where they were installed, and an instance process is handed their source from there."""
        staged = list(self._staging.values())
        for staging in staged:
            shutil.rmtree(staging, ignore_errors=True)
            if str(staging) in sys.path:
                sys.path.remove(str(staging))
        for name, module in list(sys.modules.items()):
            file = getattr(module, "__file__", None)
            if file is not None and any(Path(file).is_relative_to(s) for s in staged):
                del sys.modules[name]
        self._staging.clear()
        for folder in reversed(self._created):
            try:
                os.rmdir(folder)
            except OSError:  # not empty: the installed copies, or files of someone else's
                continue
        self._created.clear()
        for fd in self._held.values():
            os.close(fd)  # the lock goes with it
        self._held.clear()
