"""The last good version: a model version that fails (its architecture at discovery, its load at start-up or on a
management call) is passed over for the newest older one that loads, unless the manifest pins the version, and the
versions passed over are recorded on the model served, each with why (``failed_versions``)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path

from halfserve import storage, store
from halfserve.served import ServedModel
from halfserve.serving import ModelState
from halfserve.storage import StoreError

log = logging.getLogger("halfserve.repository")
"""The repository's: a model's load failures are logged as they were before this was a module of its own."""


class VersionFallback:
    """The repository's choice of a version to serve in place of one that fails: ``register`` reads a model's
    manifest for a version (its served one when ``None``), ``load`` loads and warms one up or raises why not."""

    def __init__(
        self,
        root: Path,
        register: Callable[[str, int | None], ServedModel],
        load: Callable[[ServedModel], Awaitable[None]],
    ) -> None:
        self.root = root
        self.register = register
        self.load = load

    def checked(self, served: ServedModel) -> ServedModel:
        """``served``, or its newest older version whose architecture builds and fits its checkpoint; failed, with the
        reason, when none does."""
        failed: dict[int, str] = {}
        candidate: ServedModel | None = served
        while candidate is not None:
            try:
                store.check_architecture(self.root / served.name, candidate.manifest, candidate.version)
            except StoreError as e:
                failed[candidate.version] = str(e)
                log.error("model %s v%d failed to load: %s", served.name, candidate.version, e)
                candidate = self.older(candidate)
            else:
                candidate.failed_versions = failed
                return candidate
        served.state, served.error = ModelState.FAILED, failed[served.version]
        return served

    def older(self, served: ServedModel) -> ServedModel | None:
        """The newest version of ``served``'s model older than it, to serve in its place; ``None`` when there is none
        or the manifest pins the version (the operator asked for that one)."""
        if served.manifest.version is not None:
            return None
        model_dir = self.root / served.name
        try:
            older = [v for v in storage.versions(model_dir) if v < served.version]
        except OSError:
            return None
        return self.register(served.name, older[-1]) if older else None

    async def load_newest(self, served: ServedModel) -> ServedModel:
        """Load ``served``, else its newest older version that loads (unless the version is pinned), so a version that
        fails never takes down one that would serve; the versions passed over are kept in ``failed_versions``, with
        why, and logged. Returns the model loaded, or ``served`` marked failed, with its reason, when none loads."""
        failed = dict(served.failed_versions)
        candidate: ServedModel | None = served
        while candidate is not None:
            try:
                await self.load(candidate)
            except Exception as e:  # a broken checkpoint must not stop the other models (or versions) from serving
                failed[candidate.version] = str(e)
                log.error("model %s v%d failed to load: %s", served.name, candidate.version, e)
                candidate = await asyncio.to_thread(self.older, candidate)
            else:
                candidate.failed_versions = failed
                if failed:
                    log.warning(
                        "model %s serves v%d, its newest version that loads; passed over: %s",
                        served.name,
                        candidate.version,
                        "; ".join(f"v{v}: {e}" for v, e in sorted(failed.items(), reverse=True)),
                    )
                return candidate
        served.state, served.error = ModelState.FAILED, failed[served.version]
        served.failed_versions = failed
        return served

    async def load_or_older(self, served: ServedModel, old: ServedModel | None, asked_for_version: bool) -> ServedModel:
        """Load ``served``, or raise why not; a version that fails is noted on ``old`` where that one serves, and
        where none serves and no version was asked for, the newest older version that loads is served instead."""
        try:
            await self.load(served)
        except Exception as e:
            if old is not None and old.batcher is not None:
                old.failed_versions[served.version] = str(e)
                log.error(
                    "model %s v%d failed to load; v%d goes on serving: %s", old.name, served.version, old.version, e
                )
                raise
            older = None if asked_for_version else await asyncio.to_thread(self.older, served)
            if older is None:
                raise
            log.error("model %s v%d failed to load: %s", served.name, served.version, e)
            older.failed_versions = {served.version: str(e)}
            loaded = await self.load_newest(older)
            if loaded.state is not ModelState.READY:
                raise
            return loaded
        return served
