"""What an instance process builds its model from besides the weights, captured by the server process at load and
handed over, so that a process restarted later builds what the others serve whatever the store and the code path
hold by then: the operator's ``--code-path`` module an architecture names (its source), and a Hugging Face model's
configuration (its ``config.json`` as loaded).

A module handed over is installed in the instance process under its own name and file (so ``--code-path``'s check
of where it lies still holds), run from the source the server process read, and imported from there; nothing is
read from disk. A package, or a module that imports siblings from the code path, is imported from disk as before.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from torch import nn


@dataclass(frozen=True)
class Code:
    """A single-file module of the operator's code: its name, its file, its source as read at load."""

    name: str
    origin: str
    source: bytes


_read: dict[tuple[str, str], Code] = {}
"""Modules' sources as first read, by name and file: this process keeps running the module it imported once (a
reload or a precision switch does not import it again), and so do the instance processes it starts."""


def operator_code(architecture: str, registers: str | None, code_path: Iterable[Path]) -> Code | None:
    """The ``--code-path`` module ``architecture`` comes from (``module:factory``, or the module whose import
    registered it), as this process imported it (its source read when first asked, at the model's first load); None
    when it comes from elsewhere (halfserve's own models, an installed package, a library) or is a package."""
    name = registers if registers is not None else architecture.partition(":")[0] if ":" in architecture else None
    module = sys.modules.get(name) if name is not None and "." not in name else None
    spec = getattr(module, "__spec__", None)
    if spec is None or not spec.has_location or spec.origin is None or spec.submodule_search_locations is not None:
        return None
    origin = Path(spec.origin).resolve()
    if origin.suffix != ".py" or not any(origin.is_relative_to(Path(p).resolve()) for p in code_path):
        return None
    assert name is not None
    key = (name, str(origin))
    if key not in _read:
        _read[key] = Code(name, str(origin), origin.read_bytes())
    return _read[key]


class _Handed(importlib.abc.Loader):
    """Runs a handed module's source (never its file)."""

    def __init__(self, code: Code) -> None:
        self.code = code

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return None  # the default module

    def exec_module(self, module: ModuleType) -> None:
        exec(compile(self.code.source, self.code.origin, "exec"), module.__dict__)  # noqa: S102 - the operator's code


def install(code: Code) -> None:
    """Import ``code`` under its name, from its handed source: a later import of the name finds it."""
    loader = _Handed(code)
    spec = importlib.util.spec_from_file_location(code.name, code.origin, loader=loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[code.name] = module
    try:
        loader.exec_module(module)
    except BaseException:
        del sys.modules[code.name]
        raise


def hugging_face_config(module: nn.Module) -> dict[str, Any] | None:
    """A Hugging Face model's configuration as loaded (its ``config.json``, with transformers' defaults); None for
    another model."""
    config = getattr(module, "config", None)
    to_dict = getattr(config, "to_dict", None)
    if to_dict is None:
        return None
    found: dict[str, Any] = to_dict()
    return found
