"""AOTInductor (``compile: aoti``): an engine's input preparation and forward exported with ``torch.export`` and
compiled ahead of time into a package (a shared library with the weights), kept in the compile cache, so a start
that finds it loads a library: no Dynamo tracing, no AOTAutograd, no kernel build.

The batch dimension is exported dynamic (``torch.export.Dim``, 1 to the largest bucket): one package runs every
batch size. A model whose export does not hold for a dynamic batch (a shape check on it, a reshape to a fixed size)
is exported once per batch bucket instead, a package each. A model that does not export at all is refused at load,
with torch's reason: ``aoti`` is asked for by name, and an engine that fell back to eager forwards would be served
at another speed than the one asked for, with its reason only in a log (the docs' "compile cache" section).

The packages go in the compile cache as one entry (:mod:`halfserve.compilecache`) under the engine's key with
``aoti`` as its mode and the digests of the model's code and the version's files (a package holds the weights and
the forward: :func:`halfserve.compilecache.built_from`), checked against its digest before torch sees a byte:
torch loads an altered package without a word (its library is code it runs), so a torn, truncated or altered entry
is rebuilt, never loaded.

Torch's AOTInductor entry points are ``torch._inductor``'s, not public API: read by name at run time, as
:mod:`halfserve.compilation` reads torch.compile's limits.
"""

from __future__ import annotations

import importlib
import io
import json
import logging
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from halfserve.compilecache import CacheOutcome, CacheUse, CompileCache, CorruptEntry, keep_kernels, pack, unpack
from halfserve.engine.protocol import EngineError

log = logging.getLogger(__name__)

Forward = Callable[[torch.Tensor], torch.Tensor]
DYNAMIC = 0
"""The batch size a package exported with a dynamic batch dimension is kept under: it runs every size."""
MAX_HEADER_BYTES = 4096


class _Exported(nn.Module):
    """An engine's eager forward (input preparation, model, its one output) as the module ``torch.export`` takes:
    the served model is a submodule, so its weights are the exported program's."""

    def __init__(self, model: nn.Module, eager: Forward) -> None:
        super().__init__()
        self.model = model
        self.eager = eager

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return self.eager(t)


def _torch(module: str, name: str) -> Callable[..., Any]:
    fn: Callable[..., Any] = getattr(importlib.import_module(module), name)
    return fn


def _compile(exported: Any, folder: Path, size: int) -> bytes:
    compile_and_package = _torch("torch._inductor", "aoti_compile_and_package")
    return Path(compile_and_package(exported, package_path=str(folder / f"batch-{size}.pt2"))).read_bytes()


def build(model: nn.Module, eager: Forward, example: torch.Tensor, sizes: list[int]) -> dict[int, bytes]:
    """The packages of ``eager`` (over ``model``'s weights) for inputs like ``example`` at batch sizes ``sizes``: one
    under :data:`DYNAMIC` where the batch dimension exports dynamic, else one per size. Raises :class:`EngineError`
    (naming torch's reason) for a model that does not export. Run it in the forward's precision context: the
    exported program holds the casts it makes."""
    module = _Exported(model, eager).eval()
    largest = max(sizes)
    with tempfile.TemporaryDirectory(prefix="halfserve-aoti-") as tmp:
        folder = Path(tmp)
        if largest > 1:
            batch = torch.export.Dim("batch", min=1, max=largest)
            sample = example.new_zeros((largest, *example.shape[1:]))
            try:
                exported = torch.export.export(module, (sample,), dynamic_shapes=({0: batch},))
            except Exception as e:
                log.info(
                    "AOTInductor: the batch dimension does not export dynamic, a package per bucket: %s", _first(e)
                )
            else:
                return {DYNAMIC: _compile(exported, folder, DYNAMIC)}
        packages = {}
        for size in sizes:
            try:
                exported = torch.export.export(module, (example.new_zeros((size, *example.shape[1:])),))
            except Exception as e:
                raise EngineError(f"execution.compile 'aoti': the model does not export: {_first(e)}") from None
            packages[size] = _compile(exported, folder, size)
        return packages


def _first(e: BaseException) -> str:
    """An exception's first line (torch's export errors run to pages of advice)."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def to_entry(packages: dict[int, bytes]) -> bytes:
    """A compile cache entry of ``packages``: a JSON header of their batch sizes, then each package, in its order."""
    sizes = sorted(packages)
    return pack([json.dumps({"sizes": sizes}).encode(), *(packages[s] for s in sizes)])


def from_entry(data: bytes) -> dict[int, bytes]:
    """The packages of an entry :func:`to_entry` wrote; :class:`CorruptEntry` for one that is not such an entry."""
    header, *parts = unpack(data)
    try:
        if len(header) > MAX_HEADER_BYTES:
            raise ValueError("header too long")
        sizes = json.loads(header)["sizes"]
        if not (isinstance(sizes, list) and all(type(s) is int and s >= 0 for s in sizes)):
            raise ValueError("sizes are not batch sizes")
    except (ValueError, KeyError, TypeError) as e:
        raise CorruptEntry(f"not an AOTInductor entry: {e}") from None
    if len(sizes) != len(parts):
        raise CorruptEntry(f"an AOTInductor entry names {len(sizes)} packages and holds {len(parts)}")
    return dict(zip(sizes, parts, strict=True))


class Packaged:
    """An engine's forward as its loaded packages run it: each package loaded once with a runner per instance
    (the instances' batches run at once, over one copy of the weights), an input of another dtype than the one
    exported, or of a batch size no package runs, forwarded eagerly."""

    def __init__(self, packages: dict[int, bytes], dtype: torch.dtype, eager: Forward, runners: int) -> None:
        load = _torch("torch._inductor.package", "load_package")
        self.dtype, self._eager = dtype, eager
        self.packages = {size: load(io.BytesIO(data), num_runners=runners) for size, data in packages.items()}

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        package = self.packages.get(DYNAMIC if DYNAMIC in self.packages else t.shape[0])
        if package is None or t.dtype != self.dtype:
            return self._eager(t)
        out: torch.Tensor = package(t.contiguous())
        return out


_building = threading.Lock()  # one export at a time: export and compiles are process-wide work, and memory-hungry


def packaged(
    model: nn.Module,
    eager: Forward,
    example: torch.Tensor,
    sizes: list[int],
    runners: int,
    cache: tuple[CompileCache, str] | None,
    use: CacheUse,
) -> tuple[Packaged, float]:
    """``eager`` as AOTInductor packages run it at batch sizes ``sizes``, and the seconds spent building them (0 when
    loaded): from the compile ``cache``'s entry (a folder and a key) where it holds one that matches its digest and
    loads, else built (and the entry written). ``use`` records what was found, for ``/models``."""
    folder, name = cache if cache is not None else (None, "")
    use.key = name
    if folder is not None:
        # Loading a package on a CPU has torch compile probes of the vector instructions it may use (22 s of a first
        # load on the 2-core host, against 4 s with them found), into its own cache: kept with the
        # packages, they are found at the next start.
        keep_kernels(folder)
        start = time.perf_counter()
        try:
            data = folder.read(name)
            if data is None:
                use.outcome = CacheOutcome.MISS
            else:
                found = Packaged(from_entry(data), example.dtype, eager, runners)
                use.outcome, use.cached_graphs = CacheOutcome.HIT, len(found.packages)
                return found, 0.0
        except Exception as e:
            log.warning("compile cache: entry %s rebuilt, not used: %s", name, e)
            use.outcome = CacheOutcome.CORRUPT
        finally:
            use.load_seconds += time.perf_counter() - start
    with _building:
        start = time.perf_counter()
        packages = build(model, eager, example, sizes)
        seconds = time.perf_counter() - start
    use.compiled_graphs += len(packages)
    if folder is not None:
        try:
            folder.write(name, to_entry(packages))
        except OSError as e:
            log.warning("compile cache: entry %s not written: %s", name, e)
    return Packaged(packages, example.dtype, eager, runners), seconds
