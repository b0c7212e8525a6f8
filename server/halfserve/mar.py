"""TorchServe model archives (``.mar``) read for ``halfserve import``: what the archive says, its files unpacked within
limits, and what each part becomes here.

A ``.mar`` is a zip that ``torch-model-archiver`` writes: ``MAR-INF/MANIFEST.json`` (``{"model": {"modelName",
"serializedFile", "handler", "modelFile", "modelVersion"}, "runtime", ...}``) beside the files it names, each by its
base name, and the extra files. Here:

* the serialized file is the weights: a state dict (``.pt``/``.pth``, read with ``weights_only``, or
  ``.safetensors``) as for any import. A TorchScript file or a whole pickled model is refused with the fix;
* the model file is Python code. Nothing from an archive runs unless the operator says so: with
  ``--trust-model-file`` it is copied into the operator's first ``--code-path`` folder and its one ``nn.Module``
  subclass (found by reading the file, not running it) becomes the architecture, ``mar_<name>:<Class>``; without the
  flag the import is refused with the reason and the fix (``--architecture`` of their own also does);
* the stock ``image_classifier`` handler becomes the ``torchserve`` image preset on one input of 3x224x224,
  with the archive's ``index_to_name.json`` as the labels; ``image_segmenter`` the same transforms with the
  ``segmentation`` answer; ``object_detector`` (``ToTensor`` alone, on images of any size) a resize to the input the
  operator gives and the ``detections`` answer; ``text_classifier`` and ``base_handler`` are refused with the reason;
* a handler file of the archive's own is code too: with ``--archive-code DIR`` it and the archive's other Python files
  are copied into DIR, a folder of the operator's (:func:`extract_code`), and its one class becomes the manifest's
  ``torchserve``-style handler, run by :mod:`halfserve.tscompat`; its other extra files go into the version's folder,
  the handler's ``model_dir``. Without the flag the import is refused, naming it.

The zip is read within limits (:data:`MAX_MEMBERS`, :data:`MAX_BYTES`, :data:`MAX_RATIO`): no absolute paths, no
``..``, no links, and every byte counted as it is unpacked, never trusting the sizes the zip declares.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.machinery
import json
import os
import re
import site
import stat
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from halfserve.codecopies import CodeCopies
from halfserve.storage import StoreError

MANIFEST = "MAR-INF/MANIFEST.json"
MAX_MEMBERS = 1_000
"""Files an archive may hold (a model's archive holds a handful)."""
MAX_BYTES = 8 * 1024**3
"""Bytes an archive may unpack to, all files together."""
MAX_RATIO = 200
"""How many times its compressed size a file may unpack to (weights compress about 1.1x; a zip bomb 1,000x)."""
MAX_MANIFEST_BYTES = 64 * 1024
MAX_CODE_BYTES = 16 * 1024**2
"""Bytes of Python an archive may ship to ``--archive-code``, all its ``.py`` files together."""
IMAGE_CLASSIFIER = "image_classifier"
OBJECT_DETECTOR = "object_detector"
STOCK_ANSWERS: dict[str, str | None] = {
    IMAGE_CLASSIFIER: None,
    "image_segmenter": "segmentation",
    OBJECT_DETECTOR: "detections",
}
"""The stock image handlers imported, each with the manifest's ``answer`` it becomes (:mod:`halfserve.answershapes`;
None: classification's top five)."""
REFUSED_HANDLERS = {
    "text_classifier": "import the Hugging Face folder with --architecture transformers:<AutoClass> and --text instead",
    "base_handler": "it declares no transforms: give --input and, for photos, --image",
}
IMAGE_INPUT = "input:FP32:3x224x224"
"""The input ``image_classifier`` feeds: TorchServe's transforms end in 3x224x224 floats."""
IMAGE = "image"
"""The name clients send photos under over V2 (``/predictions`` takes them as TorchServe's ``data``/``body``)."""


class MarError(StoreError):
    """An archive refused, with why and what to do."""


SHADOWED = frozenset({"ts", "halfserve", *sys.stdlib_module_names})
"""Top-level names an archive's Python files may not take, whatever is installed (:func:`_shadowed`)."""


@dataclass(frozen=True)
class Archive:
    """What an unpacked ``.mar`` gives an import."""

    name: str
    """The archive's ``modelName``, else its file's stem."""
    weights: Path
    handler: str
    model_file: Path | None
    labels: Path | None
    folder: Path
    """Where the archive is unpacked."""
    handler_file: Path | None = None
    """The archive's own handler file (None: a stock handler)."""


def _member_path(info: zipfile.ZipInfo, where: Path) -> PurePosixPath:
    name = PurePosixPath(info.filename)
    if info.filename.startswith(("/", "\\")) or "\\" in info.filename or ".." in name.parts or ":" in info.filename:
        raise MarError(f"{where}: member {info.filename[:80]!r} is not a plain relative path; refused")
    if stat.S_ISLNK(info.external_attr >> 16):
        raise MarError(f"{where}: member {info.filename[:80]!r} is a link; refused")
    return name


def unpack(path: Path, folder: Path) -> None:
    """Unpack the archive at ``path`` into ``folder`` within the limits (see the module)."""
    try:
        zf = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError) as e:
        raise MarError(f"{path}: not a TorchServe archive (a zip file): {e}") from None
    with zf:
        members = zf.infolist()
        if len(members) > MAX_MEMBERS:
            raise MarError(f"{path}: {len(members)} files, more than the {MAX_MEMBERS} an archive may hold")
        total, seen = 0, set()
        for info in members:
            name = _member_path(info, path)
            if name in seen:
                raise MarError(f"{path}: member {info.filename[:80]!r} appears twice; refused")
            seen.add(name)
            if info.is_dir():
                continue
            if info.file_size > 1024**2 and info.file_size > MAX_RATIO * max(info.compress_size, 1):
                raise MarError(
                    f"{path}: {info.filename[:80]!r} unpacks to {info.file_size} bytes from {info.compress_size}, "
                    f"more than {MAX_RATIO} times its size (a zip bomb?); refused"
                )
            target = folder.joinpath(*name.parts)
            target.parent.mkdir(parents=True, exist_ok=True)
            written = 0
            with zf.open(info) as src, target.open("xb") as dst:
                while chunk := src.read(1 << 20):
                    written += len(chunk)
                    total += len(chunk)
                    if written > info.file_size or total > MAX_BYTES:
                        raise MarError(f"{path}: unpacks to more than its sizes say or than {MAX_BYTES} bytes; refused")
                    dst.write(chunk)


def _manifest(folder: Path, path: Path) -> dict[str, object]:
    where = folder / MANIFEST
    if not where.is_file():
        raise MarError(f"{path}: no {MANIFEST}; not an archive torch-model-archiver wrote")
    if where.stat().st_size > MAX_MANIFEST_BYTES:
        raise MarError(f"{path}: {MANIFEST} is over {MAX_MANIFEST_BYTES} bytes")
    try:
        raw = json.loads(where.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise MarError(f"{path}: {MANIFEST} is not JSON: {e}") from None
    model = raw.get("model") if isinstance(raw, dict) else None
    if not isinstance(model, dict) or not all(isinstance(v, str) for v in model.values() if v is not None):
        raise MarError(f'{path}: {MANIFEST} has no "model" object of strings')
    return model


def _file(folder: Path, model: dict[str, object], key: str, path: Path) -> Path | None:
    name = model.get(key)
    if name is None:
        return None
    found = folder / PurePosixPath(str(name)).name
    if not found.is_file():
        raise MarError(f"{path}: {MANIFEST} names {key} {name!r}, which the archive does not hold")
    return found


def _check_weights(weights: Path, path: Path) -> None:
    if zipfile.is_zipfile(weights):
        with zipfile.ZipFile(weights) as z:
            if any(n.endswith("/constants.pkl") or "/code/" in n for n in z.namelist()):
                raise MarError(
                    f"{path}: {weights.name} is a TorchScript module, which halfserve does not import: save a state "
                    "dict instead (torch.save(model.state_dict(), 'model.pt')) and archive it with --model-file"
                )


def read(path: Path, folder: Path) -> Archive:
    """Unpack and read the archive at ``path`` into ``folder`` (an empty scratch folder)."""
    unpack(path, folder)
    model = _manifest(folder, path)
    weights = _file(folder, model, "serializedFile", path)
    if weights is None:
        raise MarError(f"{path}: {MANIFEST} names no serializedFile (the weights); nothing to import")
    _check_weights(weights, path)
    handler = str(model.get("handler") or "")
    if handler.removesuffix(".py") in REFUSED_HANDLERS:
        stock = handler.removesuffix(".py")
        raise MarError(f"{path}: handler {stock!r} is not imported: {REFUSED_HANDLERS[stock]}")
    handler_file = None
    if handler not in STOCK_ANSWERS:
        if ":" in handler:
            raise MarError(
                f"{path}: handler {handler!r} is a function entry point, which runs the model itself; the server runs "
                "the forward, so only a handler class (its preprocess and postprocess) is imported"
            )
        named = PurePosixPath(handler if handler.endswith(".py") else handler + ".py")
        handler_file = folder / named.name
        if not handler_file.is_file():
            if len(named.parts) > 1 and not named.is_absolute() and ".." not in named.parts:
                raise MarError(
                    f"{path}: {MANIFEST} names handler {handler!r}: a handler file is found by its base name at the "
                    f"archive's top level, where it holds no {named.name} (torch-model-archiver --handler puts it so)"
                )
            raise MarError(f"{path}: {MANIFEST} names handler {handler!r}, neither a stock handler nor a file it holds")
    labels = folder / "index_to_name.json"
    name = str(model.get("modelName") or path.stem)
    model_file = _file(folder, model, "modelFile", path)
    return Archive(
        name,
        weights,
        handler,
        model_file,
        labels if labels.is_file() else None,
        folder,
        handler_file,
    )


def module_class(model_file: Path) -> str:
    """The one ``nn.Module`` subclass ``model_file`` defines, read from its syntax (the file is not run)."""
    try:
        tree = ast.parse(model_file.read_text(encoding="utf-8"), str(model_file))
    except (SyntaxError, UnicodeDecodeError) as e:
        raise MarError(f"{model_file.name}: not Python source: {e}") from None
    found = [
        node.name
        for node in tree.body
        if isinstance(node, ast.ClassDef) and any(ast.unparse(b).split(".")[-1] == "Module" for b in node.bases)
    ]
    if len(found) != 1:
        raise MarError(
            f"{model_file.name}: defines {len(found)} nn.Module subclasses ({', '.join(found) or 'none'}); TorchServe "
            "takes the one it defines: give --architecture module:Class of your own instead"
        )
    return found[0]


def trust_model_file(archive: Archive, code_path: list[Path], copies: CodeCopies) -> str:
    """Copy the archive's model file into the operator's first ``--code-path`` folder (staged in ``copies``) and
    return its architecture string; refuses where there is no such folder, or a different file of that name is
    there."""
    assert archive.model_file is not None
    if not code_path:
        raise MarError(
            "--trust-model-file: give --code-path DIR too: the model file is copied there, and the server "
            "imports it from there (serve with the same --code-path)"
        )
    module = "mar_" + re.sub(r"\W", "_", archive.name).lower()
    target = code_path[0] / f"{module}.py"
    copies.hold(code_path[0])
    source = archive.model_file.read_bytes()
    if target.exists() and target.read_bytes() != source:
        raise MarError(f"{target} exists and differs from the archive's {archive.model_file.name}; move it first")
    cls = module_class(archive.model_file)
    copies.copy(archive.model_file, code_path[0], PurePosixPath(target.name))
    return f"{module}:{cls}"


def refused_model_file(archive: Archive) -> MarError:
    """Why an archive whose architecture is its model file is not imported without ``--trust-model-file``."""
    name = archive.model_file.name if archive.model_file is not None else "(none)"
    return MarError(
        f"the archive's model file {name} is Python code, and nothing from an archive runs unless the operator says "
        "so: read it, then import with --trust-model-file --code-path DIR (it is copied into DIR), or give "
        "--architecture of your own"
    )


def refused_handler_file(archive: Archive) -> MarError:
    """Why an archive whose handler is its own file is not imported without ``--archive-code``."""
    name = archive.handler_file.name if archive.handler_file is not None else "(none)"
    return MarError(
        f"the archive's handler {name} is its own Python code, and nothing from an archive runs unless the operator "
        "says so: read it (and the archive's other .py files), then import with --archive-code DIR: they are copied "
        "into DIR, and the server runs the handler served with --code-path DIR"
    )


def handler_class(handler_file: Path) -> tuple[str, bool]:
    """The one class ``handler_file`` defines, read from its syntax (the file is not run), as TorchServe takes it, and
    whether it is an image classifier (its input is then TorchServe's 3x224x224)."""
    try:
        tree = ast.parse(handler_file.read_text(encoding="utf-8"), str(handler_file))
    except (SyntaxError, UnicodeDecodeError) as e:
        raise MarError(f"{handler_file.name}: not Python source: {e}") from None
    found = [node for node in tree.body if isinstance(node, ast.ClassDef)]
    if len(found) != 1:
        names = ", ".join(c.name for c in found) or "none"
        raise MarError(
            f"{handler_file.name}: defines {len(found)} classes ({names}); TorchServe takes a handler file's one class"
        )
    bases = {ast.unparse(b).split(".")[-1] for b in found[0].bases}
    return found[0].name, "ImageClassifier" in bases


def code_files(archive: Archive) -> list[PurePosixPath]:
    """The archive's Python files (its handler, its model file, extra ``.py`` files), by path in the archive."""
    found = sorted(
        PurePosixPath(p.relative_to(archive.folder).as_posix())
        for p in archive.folder.rglob("*.py")
        if p.is_file() and not p.relative_to(archive.folder).as_posix().startswith("MAR-INF/")
    )
    size = sum((archive.folder / p).stat().st_size for p in found)
    if size > MAX_CODE_BYTES:
        raise MarError(f"{archive.name}: its Python files hold {size} bytes, more than the {MAX_CODE_BYTES} allowed")
    return found


def extract_code(archive: Archive, code_dir: Path, store: Path, copies: CodeCopies) -> str:
    """Copy the archive's Python files into ``code_dir`` (the operator's ``--archive-code``; staged in ``copies``)
    and return the handler's ``module:Class``. Refused where ``code_dir`` lies in the store (the server never runs
    code from there), where a file would land outside it or in the store, where one would shadow a package
    (:data:`SHADOWED`), or where a different file of that name is there already; nothing is copied then."""
    assert archive.handler_file is not None
    check_archive_code(code_dir, store)
    copies.hold(code_dir)
    where = code_dir.resolve()
    cls, _ = handler_class(archive.handler_file)
    module = handler_module(archive.handler_file)
    environment = _environment_path(where)  # once: each file's name is looked up on it
    checked = []
    for name in code_files(archive):
        source = archive.folder.joinpath(*name.parts)
        if source == archive.handler_file:
            name = name.with_name(f"{module}.py")
        top = name.parts[0] if len(name.parts) > 1 else name.stem
        shadowed = _shadowed(top, environment)
        if shadowed is not None:
            raise MarError(
                f"{archive.name}: the archive's {name} is a top-level module {top!r}, {shadowed}; refused: rename "
                "it in the archive"
            )
        target = where.joinpath(*name.parts)
        if not target.resolve().is_relative_to(where):
            raise MarError(f"--archive-code {code_dir}: {name} would land outside it (a link there?); refused")
        if target.resolve().is_relative_to(store.resolve()):  # DIR holding the store: the file would be the store's
            raise MarError(f"--archive-code {code_dir}: the archive's {name} would land in the store {store}; refused")
        if target.exists() and (not target.is_file() or target.read_bytes() != source.read_bytes()):
            raise MarError(f"{target} exists and differs from the archive's {name}; move it first")
        checked.append((source, target))
    for source, target in checked:
        copies.copy(source, where, PurePosixPath(target.relative_to(where).as_posix()))
    return f"{module}:{cls}"


def _shadowed(top: str, environment: list[str]) -> str | None:
    """What an archive's top-level module ``top`` would shadow, said as a refusal ends it, or None. First on the
    import path, a ``ts`` would shadow the compatibility package (and be taken for TorchServe's own, refusing every
    torchserve-style handler served from the folder), a ``halfserve`` the server, a standard library module the one
    the server imports. Any other module the ``environment`` path has (:func:`_environment_path`), an installed
    package, is what the server or its libraries import: the operator's folders come after it on the import path, so
    the archive's file would never run in its place."""
    if top in SHADOWED:
        what = {"ts": "the ts package halfserve runs TorchServe handlers with", "halfserve": "the server itself"}
        return f"which would shadow {what.get(top, 'the standard library module')} on the import path"
    if top in sys.builtin_module_names or importlib.machinery.PathFinder.find_spec(top, environment) is not None:
        return (
            "the name of a module this environment has installed (the server or a library it uses imports it, and "
            "an archive's file never runs in its place)"
        )
    return None


def _environment_path(code_dir: Path) -> list[str]:
    """The import path's folders the environment itself gives (its standard library and site-packages, the user's,
    ``PYTHONPATH``), without the operator's code folders a process adds (``code_dir`` among them): what the server and
    its libraries import."""
    roots = {Path(p).resolve() for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix)}
    roots.add(Path(site.getusersitepackages()).resolve())
    given = {Path(p).resolve() for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p}
    found = []
    for entry in filter(None, sys.path):
        where = Path(entry).resolve()
        if not where.is_relative_to(code_dir) and (where in given or any(where.is_relative_to(r) for r in roots)):
            found.append(entry)
    return found


def check_archive_code(code_dir: Path, store: Path) -> None:
    """Refuse an ``--archive-code`` folder that lies in the store (the store itself included): what an archive ships
    runs only from the operator's own folders, never the store's, which imports write."""
    where = code_dir.resolve()
    if where.is_relative_to(store.resolve()):
        raise MarError(
            f"--archive-code {code_dir}: lies inside the store {store}; code runs only from the operator's own "
            "folders, never the store's: name a folder outside it"
        )
    if where.exists() and not where.is_dir():
        raise MarError(f"--archive-code {code_dir}: is a file, not a folder")


def handler_module(handler_file: Path) -> str:
    """The module name a handler file is copied as: its stem and the first 8 hex digits of its SHA-256. A module name
    is one module per process, and archives' handler files are mostly ``handler.py``: two archives' different files
    must not be one module, the second model silently running the first's code. A stem that is no module name
    (``my-handler``, ``1handler``, ``a.b``, which TorchServe loads by file) has its other characters as underscores and
    a leading digit behind one (``my_handler_...``, ``_1handler_...``, ``a_b_...``): nothing imports a handler by its
    name but the manifest, which names the copy."""
    stem = re.sub(r"[^A-Za-z0-9_]", "_", handler_file.stem)
    if stem[:1].isdigit():
        stem = "_" + stem
    return f"{stem}_{hashlib.sha256(handler_file.read_bytes()).hexdigest()[:8]}"


def extra_files(archive: Archive) -> dict[str, Path]:
    """The files an archive's own handler finds in its ``model_dir`` (the version's folder): all but its weights and
    its Python files, by path in the archive (``MAR-INF/MANIFEST.json``, the handler's context's manifest,
    included)."""
    return {
        p.relative_to(archive.folder).as_posix(): p
        for p in sorted(archive.folder.rglob("*"))
        if p.is_file() and p.suffix != ".py" and p != archive.weights
    }
