"""TorchServe handler classes run as halfserve handlers (the handler section's ``torchserve`` style): a ``.mar``'s
own handler file, extracted into a ``--code-path`` folder at import (``--archive-code``), keeps working.

The file imports TorchServe's ``ts`` package; where that is not installed, ``import ts`` resolves to this folder's
``ts`` (the base, vision and image classifier handlers, ``Context``, the label helpers), and only while the handler's
module is imported (:func:`shadowing`). Where a real ``ts`` is installed the handler is refused: its
``BaseHandler.initialize`` loads the model itself (``torch.load`` or ``torch.jit.load`` of the serialized file, code
from the archive), which the server never does.

:class:`TorchServeHandler` adapts one to the server's contract (:mod:`halfserve.handlers`): ``initialize(context)``
once with the model's name, its version folder as ``model_dir`` (the archive's extra files are there), the archive's
manifest and the system properties; per request ``preprocess(data)`` on its payloads, the server's forward, and
``postprocess(output)`` on the outputs as a torch tensor. A class overriding ``inference`` or ``handle`` is refused:
the server runs the forward, batched and in half precision, and would skip them.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from halfserve.version import __version__

HERE = Path(__file__).resolve().parent
"""The folder holding this ``ts``; on ``sys.path`` while a torchserve-style handler's module is imported."""
ARCHIVE_MANIFEST = "MAR-INF/MANIFEST.json"
SKIPPED = ("inference", "handle")
"""Methods the server does not call: a handler class of its own for either is refused."""


class TorchServeHandlerError(Exception):
    """A TorchServe handler that cannot run here, and why."""


def _real_ts() -> str | None:
    """Where an installed ``ts`` lies (not this one, nor a folder named ``ts`` that is no package: a namespace
    package, which this one's ``__init__.py`` takes precedence over), or None."""
    found = sys.modules.get("ts")
    spec = found.__spec__ if found is not None else importlib.util.find_spec("ts")
    origins = list(spec.submodule_search_locations or []) if spec is not None else []
    if spec is None or spec.origin is None or any(Path(o).resolve() == HERE / "ts" for o in origins):
        return None
    return str(spec.origin or (origins[0] if origins else "ts"))


@contextlib.contextmanager
def shadowing() -> Iterator[None]:
    """``import ts`` resolving to this folder's ``ts`` while the block runs (the modules it imports stay imported,
    so a handler's own later imports of ``ts`` find them); :class:`TorchServeHandlerError` where a real one is
    installed."""
    real = _real_ts()
    if real is not None:
        raise TorchServeHandlerError(
            f"TorchServe's own ts package is installed ({real}): its BaseHandler.initialize loads the model itself, "
            "which the server does not let archive code do; serve from an environment without torchserve"
        )
    sys.path.insert(0, str(HERE))
    try:
        yield
    finally:
        sys.path.remove(str(HERE))


def check_class(factory: Any, code: str) -> type:
    """``factory`` as a TorchServe handler class: a class with ``preprocess`` and ``postprocess`` that takes over
    none of the methods the server does (:data:`SKIPPED`)."""
    if not isinstance(factory, type):
        raise TorchServeHandlerError(
            f"handler {code!r}: a TorchServe function entry point runs the model itself; the server runs the forward, "
            "so only a handler class (preprocess and postprocess around it) is imported"
        )
    missing = [m for m in ("preprocess", "postprocess") if not callable(getattr(factory, m, None))]
    if missing:
        raise TorchServeHandlerError(f"handler {code!r}: {factory.__name__} has no {' or '.join(missing)}")
    for name in SKIPPED:
        method = getattr(factory, name, None)
        if method is not None and not str(getattr(method, "__module__", "")).startswith("ts."):
            raise TorchServeHandlerError(
                f"handler {code!r}: {factory.__name__} overrides {name}, which is not called here: the server runs "
                "the forward (batched, in half precision) between preprocess and postprocess; move what it does "
                "there into preprocess or postprocess"
            )
    return factory


def context(name: str, folder: Path | None, batch_size: int, max_image_pixels: int) -> Any:
    """TorchServe's ``Context`` for the model ``name`` whose files lie in ``folder`` (its version folder; at import,
    the unpacked archive), with the server's ``max_image_pixels``."""
    from ts.context import Context  # this package's, under shadowing(): what the handler's module imported

    manifest: dict[str, Any] = {"model": {"modelName": name}}
    if folder is not None and (folder / ARCHIVE_MANIFEST).is_file():
        manifest = json.loads((folder / ARCHIVE_MANIFEST).read_text(encoding="utf-8"))
    return Context(name, str(folder or ""), manifest, batch_size, None, __version__, max_image_pixels=max_image_pixels)


class TorchServeHandler:
    """A TorchServe handler instance behind the server's ``preprocess(requests)`` and
    ``postprocess(outputs, requests)``."""

    def __init__(self, handler: Any) -> None:
        self.handler = handler

    def preprocess(self, requests: list[dict[str, Any]]) -> Any:
        inputs = self.handler.preprocess(requests)
        if isinstance(inputs, torch.Tensor):  # on the CPU and free of autograd, as the server takes a tensor
            return inputs.detach().cpu()
        return inputs

    def postprocess(self, outputs: np.ndarray | Mapping[str, np.ndarray], requests: list[dict[str, Any]]) -> Any:
        """``outputs`` as TorchServe's forward gives them: a tensor, or a tuple of the outputs in order."""
        given = (
            tuple(torch.from_numpy(np.asarray(v)) for v in outputs.values())
            if isinstance(outputs, Mapping)
            else torch.from_numpy(np.asarray(outputs))
        )
        with torch.inference_mode():
            return self.handler.postprocess(given)


def build(
    factory: Any, code: str, name: str, folder: Path | None, batch_size: int, max_image_pixels: int
) -> TorchServeHandler:
    """``factory``'s handler, initialized with the model's context (:func:`context`)."""
    cls = check_class(factory, code)
    with shadowing():
        handler = cls()
        handler.initialize(context(name, folder, batch_size, max_image_pixels))
    return TorchServeHandler(handler)
