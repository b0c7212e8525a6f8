"""Architectures: the server, the training module and ``halfserve import`` build the same ``nn.Module`` from a name.

A manifest's ``architecture`` is one of:

* a name registered here (``@register``: the shipped models) or by an installed package through the entry-point
  group ``halfserve.architectures`` (``name = "package.module:factory"`` in its metadata);
* ``"package.module:factory"``: a callable returning an ``nn.Module``, called with ``arch_kwargs``, from a module that
  lies in one of the operator's ``--code-path`` folders (:func:`add_code_path`), is the module of an installed
  ``halfserve.architectures`` entry point, or is one of this package's own (``halfserve.models``). Where the module's
  file lies is decided before it is imported (importing runs it), so a manifest cannot name ``os:system`` or a file
  shipped in its model folder. ``factory`` is a plain name of a function or class defined in that module itself (its
  ``__module__``), never a path through what the module imports (``halfserve.models:torch.load``); of an entry point's
  module only the factory its entry point declares, and of this package's own only a registered architecture;
* ``"torchvision:<builder>"`` (``torchvision:resnet50``): torchvision's builder with ``weights=None`` (the extra
  ``halfserve[vision]``);
* ``"transformers:<AutoClass>"``: a Hugging Face model folder, built by :mod:`halfserve.store` from its config.

The code is the operator's, named in the operator's configuration (as with a TorchServe handler); weights come only
from safetensors, so nothing is ever unpickled to obtain a model.
"""

from __future__ import annotations

import enum
import functools
import importlib
import importlib.util
import re
import sys
from collections.abc import Iterable, Sequence
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import torch
from torch import nn

from halfserve import manifest as _manifest
from halfserve import storage
from halfserve.models.registry import _REGISTRY, ModelFactory, register

_CODE_PATHS: list[Path] = []
"""The operator's ``--code-path`` folders, resolved: the only places a ``module:factory`` architecture's file may
lie (besides entry points' and this package's modules)."""


ENTRY_POINTS = "halfserve.architectures"
OWN_MODULES = "halfserve.models"
RENAMED_OWN_MODULES = "server.models"
"""What :data:`OWN_MODULES` was called before the package was renamed: named in a manifest, it gets the new name as a
hint (unless a ``--code-path`` folder has a ``server`` package of its own, which it then is)."""
TORCHVISION = "torchvision:"
TRANSFORMERS = "transformers:"
_PLAIN = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,127}")
_IDENTIFIER = r"[A-Za-z_][A-Za-z0-9_]*"
_DOTTED = rf"{_IDENTIFIER}(?:\.{_IDENTIFIER})*"
# The factory's part is matched dotted so that such a name is a valid manifest whose model fails alone with the reason
# (:func:`_imported` refuses it), as a module outside the --code-path folders does.
_IMPORT = re.compile(rf"({_DOTTED}):({_DOTTED})")
_LIBRARY = re.compile(r"(torchvision|transformers):([A-Za-z_][A-Za-z0-9_]*)")


class UnknownArchitectureError(KeyError):
    """The manifest names an architecture that cannot be found or does not build a model."""

    def __str__(self) -> str:
        return str(self.args[0])


def _installed() -> dict[str, Any]:
    """Architectures installed packages register (entry points, not loaded)."""
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINTS)}


def _forms() -> str:
    known = ", ".join(names())
    return (
        f"a registered name ({known}), 'package.module:factory', 'torchvision:<builder>' or 'transformers:<AutoClass>'"
    )


def check_name(name: str) -> str:
    """``name`` if it has one of the architecture forms (registered names must be known); nothing is imported."""
    if name in _REGISTRY or _LIBRARY.fullmatch(name) or _IMPORT.fullmatch(name) or name in _installed():
        return name
    if _PLAIN.fullmatch(name):
        raise ValueError(f"unknown architecture {name!r}; expected {_forms()}")
    raise ValueError(f"{name!r} is not an architecture; expected {_forms()}")


_STORES: list[Path] = []
"""The model stores this process serves or imports into, resolved: no module whose file lies in one is run, whatever
``--code-path`` folder the store lies in (:func:`forbid_store`)."""


def forbid_store(store: Path) -> None:
    """Refuse every module whose file lies in ``store`` (outside a ``--code-path`` folder named inside it): a model
    folder runs no code, even where the store lies inside a ``--code-path`` folder. Process-wide: called at start-up
    after :func:`add_code_path`, whose folders are held to :func:`check_code_folder` here (a
    :class:`~halfserve.storage.StoreError` names the first refused)."""
    folder = Path(store).resolve()
    if folder not in _STORES:
        _STORES.append(folder)
    for code in _CODE_PATHS:
        check_code_folder(folder, code)


def check_code_folder(store: Path, folder: Path, flag: str = "--code-path", importing: str | None = None) -> None:
    """Refuse a code folder (``flag``'s) that is the model store itself or lies in one of its model folders
    (``importing``'s, the model an import is about to write, included), naming the flag, the folder and why: an import
    writes a model's folder from an archive (its extra files, in the version's folder), so a code folder there would
    make the store's files code. A folder of the store's that is no model's (``<store>/code``) stays the operator's."""
    root, where = Path(store).resolve(), Path(folder).resolve()
    if where == root:
        reason = "is the model store itself"
    elif (model := storage.model_folder_holding(root, where, importing)) is not None:
        reason = f"lies in the model folder {model} of the store {root}"
    else:
        return
    raise storage.StoreError(
        f"{flag} {folder}: {reason}; imports write the store's model folders, and code runs only from the operator's "
        "own folders: name a folder outside the store"
    )


def _in_store(location: str, rest: Sequence[str]) -> Path | None:
    """The store that ``rest`` (a module's dotted path below its top-level package) found from ``location`` (that
    package's file or folder) lies in, or None."""
    where = Path(location).resolve()
    if where.name == "__init__.py":
        where = where.parent
    candidate = where.joinpath(*rest)
    for store in _STORES:
        if not (where.is_relative_to(store) or candidate.is_relative_to(store)):
            continue
        # A --code-path folder the operator named inside the store (not the store itself) is theirs while it lies in
        # no model folder (an import may have made it one since start-up); the rest is not.
        named = [
            c
            for c in _CODE_PATHS
            if c.is_relative_to(store) and c != store and storage.model_folder_holding(store, c) is None
        ]
        if not any(where.is_relative_to(c) and candidate.is_relative_to(c) for c in named):
            return store
    return None


def _under_code_path(location: str) -> bool:
    where = Path(location).resolve()
    return any(where.is_relative_to(folder) for folder in _CODE_PATHS)


class Source(enum.Enum):
    """Where a ``module:factory`` architecture's module may come from, each with its rule for the factory."""

    OWN = "halfserve's own models"
    """``halfserve.models``: only a registered architecture."""
    ENTRY_POINT = "an installed entry point"
    """An installed ``halfserve.architectures`` entry point's module: only the factory the entry point declares."""
    CODE_PATH = "a --code-path folder"
    """A module in one of the operator's folders: any function or class it defines."""


def _declared() -> set[str]:
    """The ``module:factory`` targets installed entry points declare."""
    return {ep.value.replace(" ", "") for ep in entry_points(group=ENTRY_POINTS)}


def check_source(module_name: str, name: str, what: str = "architecture") -> Source:
    """Where the module of a ``module:factory`` architecture comes from; :class:`UnknownArchitectureError` when it is
    not the operator's code: it must lie in a ``--code-path`` folder, be an installed ``halfserve.architectures``
    entry point's module, or be this package's own. Decided from where the module's file lies (``find_spec`` of its
    top-level package, which imports nothing), never by importing it: an import runs the module."""
    if module_name == OWN_MODULES or module_name.startswith(OWN_MODULES + "."):
        return Source.OWN
    top = module_name.split(".")[0]
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError) as e:  # ValueError: a module in sys.modules without a spec
        raise UnknownArchitectureError(f"{what} {name!r}: module {top!r} cannot be found: {e}") from None
    # A module's file, or every folder of a package without one (a namespace package may span several folders).
    locations: list[str] = []
    if spec is not None:
        locations = [spec.origin] if spec.has_location and spec.origin else list(spec.submodule_search_locations or [])
    in_store = next((s for p in locations if (s := _in_store(p, module_name.split(".")[1:]))), None)
    if in_store is not None:
        raise UnknownArchitectureError(
            f"{what} {name!r}: module {module_name!r} lies in the model store {in_store}: a model folder runs no code, "
            "even where the store lies in a --code-path folder; move the module to a --code-path folder outside it"
        )
    if locations and all(_under_code_path(p) for p in locations):
        return Source.CODE_PATH
    if any(target.partition(":")[0] == module_name for target in _declared()):
        return Source.ENTRY_POINT
    if module_name == RENAMED_OWN_MODULES or module_name.startswith(RENAMED_OWN_MODULES + "."):
        own = name.replace(RENAMED_OWN_MODULES, OWN_MODULES, 1)
        raise UnknownArchitectureError(
            f"{what} {name!r}: the package 'server' is now 'halfserve': write {own!r} (or the registered name alone)"
        )
    if spec is None:
        raise UnknownArchitectureError(
            f"{what} {name!r}: module {top!r} not found (is its folder given with --code-path?)"
        )
    found = locations[0] if locations else spec.origin or "built in"
    raise UnknownArchitectureError(
        f"{what} {name!r}: module {top!r} ({found}) is not in a --code-path folder nor an installed "
        f"{ENTRY_POINTS} entry point; a manifest may name code only from the operator's --code-path folders, "
        "entry points, or halfserve's own models"
    )


def _imported(module_name: str, attribute: str, name: str, what: str = "architecture") -> Any:
    """The factory ``attribute`` of ``module_name``, checked against its source's rule before and after the import:
    the attribute walk through a module's imports (``halfserve.models:torch.load``, ``...:sys.exit``) reached any
    function of any library with the manifest's ``arch_kwargs``."""
    where = f"{what} {name!r}"
    if not re.fullmatch(_IDENTIFIER, attribute):
        raise UnknownArchitectureError(
            f"{where}: the part after ':' must be the plain name of a function or class defined in {module_name!r}, "
            f"not the dotted path {attribute!r}"
        )
    source = check_source(module_name, name, what)
    if source is Source.ENTRY_POINT and f"{module_name}:{attribute}" not in _declared():
        raise UnknownArchitectureError(
            f"{where}: module {module_name!r} is an installed {ENTRY_POINTS} entry point's, which declares other "
            "factories; name the entry point instead"
        )
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        hint = " (is its folder given with --code-path?)" if e.name == module_name.split(".")[0] else ""
        raise UnknownArchitectureError(f"{where}: module {e.name!r} not found{hint}") from None
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # the operator's module failed while it was imported (a SystemExit included)
        raise UnknownArchitectureError(f"{where}: importing {module_name!r} failed: {type(e).__name__}: {e}") from None
    if not hasattr(module, attribute):
        raise UnknownArchitectureError(f"{where}: module has no attribute {attribute!r}")
    factory = getattr(module, attribute)
    defined_in = getattr(factory, "__module__", None)
    if callable(factory) and defined_in != module_name:
        raise UnknownArchitectureError(
            f"{where}: {attribute!r} is not defined in module {module_name!r} (it comes from {defined_in!r}); "
            "name a function or class of the module itself"
        )
    if source is Source.OWN and factory not in _REGISTRY.values():
        raise UnknownArchitectureError(
            f"{where}: of halfserve's own models only the registered architectures may be named ({', '.join(names())})"
        )
    return factory


PYTORCH_WHEELS = "https://download.pytorch.org/whl"


def torchvision_install() -> str:
    """The command that installs the torchvision built for this torch from PyTorch's own wheel index: PyPI's Linux
    torchvision is built against the CUDA torch, so beside a CPU-only torch its operators do not load (``operator
    torchvision::nms does not exist``). ``--force-reinstall``: PyPI's build has the same version number, so pip would
    answer "Requirement already satisfied" and change nothing; ``--no-deps``: the torch installed stays."""
    release = torch.__version__.split("+")[0]
    major, minor, patch = (release.split(".") + ["0", "0"])[:3]
    # torchvision 0.N pairs with torch 2.(N - 15), the same patch release (0.28.0 with 2.13.0) since torch 2.0.
    vision = f"0.{int(minor) + 15}.{patch}" if major == "2" and minor.isdigit() else "<the release for this torch>"
    index = "cpu" if torch.version.cuda is None else "cu" + torch.version.cuda.replace(".", "")
    return f"pip install --force-reinstall --no-deps torchvision=={vision} --index-url {PYTORCH_WHEELS}/{index}"


@functools.cache
def broken_torchvision() -> str | None:
    """Why the installed torchvision does not import (a build for another torch); None when it imports or is not
    installed. A broken one is then hidden from this process (``None`` in ``sys.modules``: ``find_spec`` and
    ``import`` both find nothing), so the libraries that use torchvision only where present (transformers' image
    utilities, imported by every model's code) go on without it instead of failing on its import."""
    if "torchvision" in sys.modules or importlib.util.find_spec("torchvision") is None:
        return None
    try:
        import torchvision  # noqa: F401
    except Exception as e:  # its C++ operators do not load: a RuntimeError, not an ImportError
        for module in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[module]
        sys.modules["torchvision"] = None  # type: ignore[assignment]
        return f"{type(e).__name__}: {e}"
    return None


def _torchvision(builder: str, name: str) -> ModelFactory:
    broken = broken_torchvision()
    if broken is not None:
        raise UnknownArchitectureError(
            f"architecture {name!r}: torchvision is installed but does not import with this torch "
            f"({torch.__version__}: {broken}); reinstall it from PyTorch's wheel index: {torchvision_install()}"
        )
    try:
        # An optional extra, imported where asked for.
        import torchvision.models
    except ImportError as e:
        raise UnknownArchitectureError(
            f"architecture {name!r}: torchvision is not installed; install it with this torch from PyTorch's wheel "
            f"index: {torchvision_install()}" + ("" if isinstance(e, ModuleNotFoundError) else f" ({e})")
        ) from None
    except Exception as e:  # a torchvision built for another torch, found broken by another way in
        raise UnknownArchitectureError(
            f"architecture {name!r}: torchvision does not import with this torch: {type(e).__name__}: {e}; "
            f"install both from PyTorch's wheel index: {torchvision_install()}"
        ) from None
    try:
        factory = torchvision.models.get_model_builder(builder)
    except ValueError:
        raise UnknownArchitectureError(
            f"architecture {name!r}: torchvision has no model builder {builder!r} "
            "(torchvision.models.list_models() lists them)"
        ) from None
    return functools.partial(factory, weights=None)


def resolve(name: str) -> ModelFactory:
    """The factory ``name`` stands for, importing what it names; :class:`UnknownArchitectureError` says why not.

    ``transformers:`` architectures are built from their model folder by :mod:`halfserve.store`, not here.
    """
    factory = _REGISTRY.get(name)
    if factory is not None:
        return factory
    library = _LIBRARY.fullmatch(name)
    if library and library[1] == "torchvision":
        return _torchvision(library[2], name)
    if library:
        raise UnknownArchitectureError(f"architecture {name!r} is built from its model folder (halfserve.store.load)")
    dotted = _IMPORT.fullmatch(name)
    installed = _installed().get(name) if dotted is None else None
    if installed is not None:
        try:
            factory = installed.load()
        except KeyboardInterrupt:
            raise
        except BaseException as e:  # the installed package's module fails to import (a SystemExit included)
            raise UnknownArchitectureError(
                f"architecture {name!r} (entry point {installed.value!r}): {type(e).__name__}: {e}"
            ) from None
    elif dotted is not None:
        factory = _imported(dotted[1], dotted[2], name)
    else:
        known = ", ".join(names())
        raise UnknownArchitectureError(f"unknown architecture {name!r} (registered: {known})")
    if not callable(factory):
        raise UnknownArchitectureError(f"architecture {name!r}: {type(factory).__name__} object is not callable")
    return factory  # type: ignore[no-any-return]


def resolve_code(name: str, what: str) -> Any:
    """The class or function ``module:name`` names, under the architectures' trust rule (:func:`check_source`): its
    module must lie in a ``--code-path`` folder (or be an installed entry point's); ``what`` names it in errors (a
    ``handler``). :class:`UnknownArchitectureError` says why not."""
    dotted = _IMPORT.fullmatch(name)
    if dotted is None:
        raise UnknownArchitectureError(f"{what} {name!r}: expected 'package.module:Name'")
    return _imported(dotted[1], dotted[2], name, what)


def check_module(module: object, name: str) -> nn.Module:
    """``module`` as an ``nn.Module``, or the error saying what ``name``'s factory returned instead."""
    if not isinstance(module, nn.Module):
        raise UnknownArchitectureError(f"architecture {name!r} returned {type(module).__name__}, not a torch.nn.Module")
    return module


def build(name: str, **kwargs: Any) -> nn.Module:
    """Build a fresh (randomly initialised) model of architecture ``name``. A ``TypeError`` means ``kwargs`` do not
    fit the factory."""
    return check_module(resolve(name)(**kwargs), name)


def registered_in(name: str) -> str | None:
    """The module whose import registered architecture ``name`` in this process (None: not registered here), so
    that another process (an instance process) can register it the same way."""
    factory = _REGISTRY.get(name)
    return None if factory is None else getattr(factory, "__module__", None)


def names() -> list[str]:
    """Registered architecture names, installed packages' included."""
    return sorted({*_REGISTRY, *_installed()})


def add_code_path(paths: Iterable[Path]) -> None:
    """Put the operator's folders on the import path (once each, in order), so ``module:factory`` architectures in
    them import, and make them the folders such architectures may come from (:func:`check_source`). After the
    installed packages, never before: a file there named as a module the server or a library imports (``numpy.py``,
    ``uvloop.py``) is never what they get, in this process or the processes it spawns (which start from its path).
    Process-wide: called once at start-up, before manifests are resolved."""
    # Before the folders added earlier (the last given is the one a process serves from), after everything else.
    earlier = [i for i, entry in enumerate(sys.path) if entry and Path(entry).resolve() in _CODE_PATHS]
    at = earlier[0] if earlier else len(sys.path)
    for path in reversed(list(paths)):
        folder = Path(path).resolve()
        if not folder.is_dir():
            raise UnknownArchitectureError(f"code path {str(path)!r} is not a folder")
        if str(folder) not in sys.path:
            sys.path.insert(at, str(folder))
        if folder not in _CODE_PATHS:
            _CODE_PATHS.append(folder)
    importlib.invalidate_caches()


# Importing the modules registers their architectures.
from halfserve.models import cnn, mlp, resnet, transformer  # noqa: E402, F401

# Manifests validate their architecture with this module's check wherever it is imported (a model can be built).
_manifest.check_architectures_with(check_name)

__all__ = [
    "Source",
    "UnknownArchitectureError",
    "add_code_path",
    "build",
    "check_code_folder",
    "check_source",
    "check_module",
    "check_name",
    "registered_in",
    "names",
    "register",
    "resolve",
    "resolve_code",
]
