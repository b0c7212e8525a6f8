"""The compile cache: an ``inductor`` engine's compiled artifacts kept on disk, so a restart, a second instance or an
instance process loads them instead of compiling.

An entry is torch's own "mega-cache" (:func:`torch.compiler.save_cache_artifacts`: the FX graphs TorchInductor
built, their AOTAutograd wrappers, autotuning results), written after warm-up under a key of everything that changes
the code compiled: the model version, precision, device, torch, Python and halfserve versions, batch buckets,
execution mode, mixed-precision plan (:func:`engine_key`); an AOTInductor entry, which holds the weights and the
compiled forward, also by the digests of the model's code and of the version's files (:func:`built_from`). At the
next warm-up under that key it goes back into torch's caches (:func:`torch.compiler.load_cache_artifacts`) before
the first forward, and the FX graphs are found instead of built.

What it holds and what still runs: the entry has TorchInductor's FX graph artifacts (the generated wrapper code),
AOTAutograd's and the autotuning results, and on a GPU the Triton kernels built (torch bundles them into the FX graph
artifacts). Dynamo still traces the Python and AOTAutograd still runs at every start, and on a CPU the C++ kernels are
not in the entry: torch builds them again unless its own kernel cache (``TORCHINDUCTOR_CACHE_DIR``, by default
``/tmp/torchinductor_<user>``) still holds them. Measured on the 2-core EPYC host (shared, so rough), a 64-32-10 MLP
compiled at batches 1 and 8 in a fresh process with an empty ``TORCHINDUCTOR_CACHE_DIR``: first forwards 11.9, 13.3
and 18.0 s without an entry (``fxgraph_cache_miss`` 2), 10.4 and 13.3 s with it (0.18-0.26 s to load 322 kB;
``fxgraph_cache_hit`` 2, no miss), and the 8 C++ kernels compiled again either way: on a CPU the kernel cache is
what saves time (``benchmarks/compile_cache_bench.py``).

Each entry has a digest file beside it, checked before torch sees its bytes: a torn, truncated or altered entry is
rebuilt, never loaded. Torch's own caches key their artifacts by the graph they compile, so an entry that no longer
fits (another torch build under the same version string) only misses: the engine compiles, says so
(:attr:`CacheOutcome.STALE`) and writes the entry again. Torch's caches are process-wide, so an engine's recording
(cleared, warmed, saved) holds one lock: another engine's compiles do not land in its entry.

The entries are code torch runs (compiled kernels), as its own cache under ``/tmp/torchinductor_<user>`` is: the
folder must be the server user's alone. One that others can write to is not used (a WARNING; the engine compiles).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import importlib
import json
import logging
import os
import stat
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from enum import Enum
from pathlib import Path
from typing import Protocol

import torch

from halfserve import codedigest
from halfserve.execution import Compile
from halfserve.hostinfo import cpu_model
from halfserve.manifest import Manifest, Precision
from halfserve.version import __version__

log = logging.getLogger(__name__)

FORMAT = 3
"""The layout of a key's parts; a change makes every older entry a miss."""
ENTRY_SUFFIX = ".artifacts"
DIGEST_SUFFIX = ".sha256"
MAX_ENTRY_BYTES = 512 * 2**20
"""The largest entry read or written (a ResNet-50 compiled at five buckets is a few MB)."""
MAX_FOLDER_BYTES = 2 * 2**30
"""What the folder's entries may hold together: past it, the least recently written go when an entry is written."""
OFF = "off"
AUTO = "auto"


class CacheOutcome(str, Enum):
    """What an ``inductor`` engine's warm-up found in the compile cache."""

    HIT = "hit"
    """Its entry was loaded and nothing was compiled."""
    MISS = "miss"
    """No entry under its key: compiled, and the entry written."""
    STALE = "stale"
    """Its entry was loaded but did not cover every graph: those compiled, and the entry written again."""
    CORRUPT = "corrupt"
    """Its entry failed its digest, or torch refused it: compiled, and the entry written again."""
    OFF = "off"
    """No cache: ``--compile-cache off``, a folder that cannot be used, or an engine that does not compile."""


class CompiledEngine(Protocol):
    """What of an engine its key is made of (:class:`halfserve.engine.core.Engine`)."""

    manifest: Manifest
    version: int
    precision: Precision
    device: torch.device
    fp32_modules: tuple[str, ...]
    input_precision: Precision
    channels_last: bool
    inductor: bool
    """Whether it compiles with torch.compile (else with AOTInductor: the other mode cached)."""

    @property
    def built_from(self) -> Mapping[str, object] | None:
        """:func:`built_from` its version (asked only of an AOTInductor engine with a usable cache)."""


class CorruptEntry(Exception):
    """An entry whose bytes are not those its digest file names (or that is too large to be one)."""


@dataclasses.dataclass
class CacheUse:
    """What one engine's compiles got from the cache (shown in ``/models``)."""

    outcome: CacheOutcome = CacheOutcome.OFF
    load_seconds: float = 0.0
    """Reading, checking and loading its entry into torch's caches."""
    compiled_graphs: int = 0
    """FX graphs TorchInductor compiled during its warm-ups (``fxgraph_cache_miss``)."""
    cached_graphs: int = 0
    """FX graphs found in torch's caches instead (``fxgraph_cache_hit``)."""
    key: str = ""
    """The key its entry is under (empty until its first warm-up)."""
    saved: list[bytes] = dataclasses.field(default_factory=list, repr=False)
    """What torch saved after each of its warm-ups under :attr:`key`: the entry holds them all (:func:`pack`)."""


_LENGTH = 8


def pack(parts: list[bytes]) -> bytes:
    """One entry of several of torch's saves, each behind its length. Torch's own bytes hold every save since its
    recording began, but it reads back only the last save's artifacts of each kind (torch 2.13): a recompile's save
    would hide the first compile's, so each is a save of its own, loaded in turn."""
    return b"".join(len(p).to_bytes(_LENGTH, "big") + p for p in parts)


def unpack(data: bytes) -> list[bytes]:
    parts, at = [], 0
    while at < len(data):
        size = int.from_bytes(data[at : at + _LENGTH], "big")
        at += _LENGTH
        if size == 0 or at + size > len(data):
            raise CorruptEntry("an entry's parts do not add up to its length")
        parts.append(data[at : at + size])
        at += size
    return parts


def key(parts: Mapping[str, object]) -> str:
    """The entry name of ``parts`` (JSON values): a SHA-256 of their canonical JSON, with :data:`FORMAT`."""
    text = json.dumps({"format": FORMAT, **parts}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def runtime_parts(device: torch.device, cpu_name: str) -> dict[str, object]:
    """The parts of a key that the host and its software decide: the device's name (a CPU's model and the vector
    instructions torch uses there: the kernels are built for them), the torch and Python versions, and halfserve's
    (what it exports around the model, its input preparation and casts, is its own code)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = f"{cpu_name} ({torch.backends.cpu.get_cpu_capability()})"
    return {
        "device": name,
        "torch": torch.__version__,
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
        "halfserve": __version__,
    }


def built_from(name: str, version_dir: Path, manifest: Manifest) -> dict[str, object] | None:
    """What an AOTInductor package of model ``name``'s version in ``version_dir`` was built from, beyond the key's
    other parts: the code that builds the model (:func:`halfserve.codedigest.of`) and the version's files
    (:func:`halfserve.codedigest.files_digest`), as a precision record has them. A package holds the weights and the
    compiled forward and is loaded as is, so a version whose files changed under the same number, or whose code was
    edited, must not find it.

    ``None`` where the code cannot be digested: no entry could say which code it holds, so the engine neither reads
    nor writes one (one INFO line says so) and compiles at every start."""
    code = codedigest.of(manifest.architecture)
    if code is None:
        log.info(
            "%s: compile cache not used, compiled at every start: the code of its architecture %r cannot be digested "
            "(more than %d files or %d bytes, or no module's), so no entry could say which code it holds",
            *(name, manifest.architecture, codedigest.MAX_FILES, codedigest.MAX_BYTES),
        )
        return None
    return {"code": code, "files": codedigest.files_digest(version_dir, manifest)}


def engine_key(engine: CompiledEngine, sizes: list[int]) -> str | None:
    """The entry name of ``engine`` compiled at batch sizes ``sizes``; ``None`` for an AOTInductor engine whose
    model's code cannot be digested (:func:`built_from`): it has no entry.

    An ``inductor`` entry's key leaves out the code and the files: its FX graphs are keyed again by torch, by the
    graph Dynamo traces from the code at every start, and take the weights as inputs (torch's ``freezing`` is off),
    so edited code only misses (:attr:`CacheOutcome.STALE`) and other weights change nothing compiled."""
    m = engine.manifest
    built: Mapping[str, object] = {}
    if not engine.inductor:
        found = engine.built_from
        if found is None:
            return None
        built = found
    parts = {
        "model": m.name,
        "version": engine.version,
        "architecture": m.architecture,
        "compile": (Compile.INDUCTOR if engine.inductor else Compile.AOTI).value,
        "precision": engine.precision.value,
        "fp32_modules": sorted(engine.fp32_modules),
        # The dtype a plan's packages give the model's inputs (fp32; earlier halfserve gave the half dtype, which a
        # kept first module then read rounded): an entry of the other is not reused.
        **({"inputs_as": engine.input_precision.value} if engine.fp32_modules else {}),
        "buckets": sorted(sizes),
        "channels_last": engine.channels_last,
        "inputs": [t.model_dump(mode="json") for t in m.inputs],
        "normalize": m.normalize.model_dump(mode="json") if m.normalize else None,
        **built,
    }
    return key({**parts, **runtime_parts(engine.device, cpu_model())})


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class CompileCache:
    """A folder of entries, each ``<key>.artifacts`` with its ``<key>.sha256``."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    @functools.cached_property
    def usable(self) -> bool:
        """Whether the folder exists (made if not), is writable and is not writable by others; checked once, on first
        use, with a WARNING when not."""
        try:
            self.folder.mkdir(parents=True, exist_ok=True, mode=0o700)
            mode = self.folder.stat().st_mode
            if mode & (stat.S_IWGRP | stat.S_IWOTH):
                why = "others can write to it (it holds code torch runs: chmod go-w)"
            elif not os.access(self.folder, os.W_OK | os.X_OK):
                why = "it is not writable"
            else:
                return True
        except OSError as e:
            why = str(e)
        log.warning("compile cache %s is not used, inductor models compile at every start: %s", self.folder, why)
        return False

    def _paths(self, name: str) -> tuple[Path, Path]:
        return self.folder / f"{name}{ENTRY_SUFFIX}", self.folder / f"{name}{DIGEST_SUFFIX}"

    def read(self, name: str) -> bytes | None:
        """The entry under ``name``: None when there is none; :class:`CorruptEntry` when its bytes fail its digest."""
        entry, check = self._paths(name)
        try:
            size = entry.stat().st_size
        except FileNotFoundError:
            return None
        if size > MAX_ENTRY_BYTES:
            raise CorruptEntry(f"{entry} holds {size} bytes, more than an entry may ({MAX_ENTRY_BYTES})")
        data = entry.read_bytes()[: MAX_ENTRY_BYTES + 1]
        try:
            expected = check.read_text(encoding="ascii").strip()
        except (FileNotFoundError, UnicodeDecodeError):
            raise CorruptEntry(f"{check} is missing or not a digest") from None
        if digest(data) != expected:
            raise CorruptEntry(f"{entry} does not match its digest {check.name}")
        return data

    def write(self, name: str, data: bytes) -> None:
        """Write the entry, then its digest, each as a whole (a temporary file renamed over it): a reader sees an old
        or new entry and digest, and a pair that do not match is rebuilt. Then drop the oldest entries past
        :data:`MAX_FOLDER_BYTES`."""
        if len(data) > MAX_ENTRY_BYTES:
            log.warning("compile cache: an entry of %d bytes is larger than an entry may be; not written", len(data))
            return
        entry, check = self._paths(name)
        _replace(entry, data)
        _replace(check, digest(data).encode("ascii"))
        self._trim(keep=entry)

    def _trim(self, keep: Path) -> None:
        entries = []
        for path in self.folder.glob(f"*{ENTRY_SUFFIX}"):
            with contextlib.suppress(FileNotFoundError):
                entries.append((path.stat().st_mtime, path.stat().st_size, path))
        total = sum(size for _, size, _ in entries)
        for _, size, path in sorted(entries):
            if total <= MAX_FOLDER_BYTES:
                break
            if path != keep:
                for gone in (path, path.with_suffix(DIGEST_SUFFIX)):
                    gone.unlink(missing_ok=True)
                total -= size


def _replace(path: Path, data: bytes) -> None:
    # Owner-only (mkstemp's mode), unlike the store's files: an entry is code torch runs.
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@functools.cache  # one per process, so its folder is checked (and a WARNING given) once
def from_setting(setting: str, store: Path) -> CompileCache | None:
    """The compile cache the ``compile_cache`` setting names (None: ``off``): ``auto`` is ``<store>/.cache/compile``,
    beside the models and outside every model's folder (the store skips names that start with a dot)."""
    if setting == OFF:
        return None
    if setting == AUTO:
        return CompileCache(store / ".cache" / "compile")
    return CompileCache(Path(setting))


KERNELS = "torchinductor"
"""The folder, in the compile cache's, that holds torch's own kernel cache unless the operator named one."""


def keep_kernels(cache: CompileCache) -> None:
    """Put torch's own kernel cache (``TORCHINDUCTOR_CACHE_DIR``) in the compile cache's folder, unless the operator,
    or an earlier ``torch.compile`` (torch sets it then: call this before), already named one.

    On a CPU an entry does not hold the C++ kernels, and loaded without them every kernel is built again: ready in
    33 s with no entry, 57 s from an entry without its kernels, 13 s with them (the digits MLP; ResNet-20: 311, 262,
    37 s; ``benchmarks/results/compile-cache-cpu``). Kept with the entries, they outlive a container's
    ``/tmp``. Torch names each kernel file by a hash of its source, and the server does not check them."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache.folder / KERNELS))


# Torch's recording of cache artifacts and its counters are process-wide: one engine's warm-up at a time.
_recording = threading.Lock()


def _counts() -> tuple[int, int]:
    """Torch's FX graph cache hits and misses so far in this process: ``torch._dynamo.utils.counters``, not public
    API, read where it is (as :mod:`halfserve.compilation` reads its limits), 0 and 0 where a release moved it."""
    try:
        counters = getattr(importlib.import_module("torch._dynamo.utils"), "counters", None)
    except ImportError:
        counters = None
    if counters is None:
        return 0, 0
    inductor = counters["inductor"]
    return int(inductor["fxgraph_cache_hit"]), int(inductor["fxgraph_cache_miss"])


def _start_recording() -> None:
    """Forget the artifacts torch recorded so far (other engines'), so the entry saved holds this engine's."""
    manager = getattr(getattr(torch.compiler, "_cache", None), "CacheArtifactManager", None)
    if manager is not None:
        manager.clear()


def _load(cache: CompileCache, name: str, use: CacheUse) -> None:
    """Read the entry ``name`` into torch's caches and set ``use``'s outcome."""
    start = time.perf_counter()
    try:
        data = cache.read(name)
        if data is None:
            use.outcome = CacheOutcome.MISS
            return
        for part in unpack(data):
            # torch logs and returns None for bytes it cannot read; other failures raise.
            if torch.compiler.load_cache_artifacts(part) is None:
                raise CorruptEntry(f"torch {torch.__version__} could not read entry {name}")
        use.outcome = CacheOutcome.HIT
    except Exception as e:
        log.warning("compile cache: entry %s rebuilt, not used: %s", name, e)
        use.outcome = CacheOutcome.CORRUPT
    finally:
        use.load_seconds += time.perf_counter() - start


def _save(cache: CompileCache, name: str, use: CacheUse) -> None:
    saved = torch.compiler.save_cache_artifacts()
    _start_recording()  # the next save holds what is recorded after this one (see pack)
    if saved is None:
        log.warning("compile cache: torch recorded no artifacts to write under %s", name)
        return
    use.saved.append(saved[0])
    try:
        cache.write(name, pack(use.saved))
    except OSError as e:
        log.warning("compile cache: entry %s not written: %s", name, e)


def warming(
    cache: CompileCache | None, use: CacheUse, engine: CompiledEngine | None, sizes: list[int]
) -> contextlib.AbstractContextManager[None]:
    """What an engine's warm-up runs in: for a torch.compile ``engine`` (None for one that is not), :func:`compiling`
    under its key at batch sizes ``sizes``, so its entry is read before the compiles and written after."""
    if engine is None:
        return contextlib.nullcontext()
    name = engine_key(engine, sizes)
    return compiling(cache if name is not None else None, name or "", use)


@contextlib.contextmanager
def compiling(cache: CompileCache | None, name: str, use: CacheUse) -> Iterator[None]:
    """Around an engine's warm-up (which compiles): load its entry ``name`` the first time (under that key), count
    the FX graphs compiled and found, and write the entry unless it was a hit that compiled nothing.

    A later warm-up under the same key (a recompile at another thread count) adds its artifacts to the entry: the
    entry written holds every save under the key (:func:`pack`). Torch records a graph found in its caches as well
    as one compiled, so an entry written after a hit's warm-up holds that warm-up's graphs too."""
    with _recording:
        on = cache is not None and cache.usable
        if name != use.key:
            use.key, use.saved = name, []
            if cache is not None and on:
                _load(cache, name, use)
            else:
                use.outcome = CacheOutcome.OFF
            _start_recording()
        hits, misses = _counts()
        yield
        new_hits, new_misses = _counts()
        use.cached_graphs += new_hits - hits
        use.compiled_graphs += new_misses - misses
        if new_misses > misses and use.outcome is CacheOutcome.HIT:
            use.outcome = CacheOutcome.STALE
        if cache is not None and on and (new_misses > misses or use.outcome is not CacheOutcome.HIT):
            _save(cache, name, use)
