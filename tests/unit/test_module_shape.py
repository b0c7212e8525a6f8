"""The package's shape beyond its layering (tests/unit/test_layering.py): modules small enough to read, one import
path per name, the store's folders and files owned by one torch-free module that the management routes reach only
through the serving contract, and a load test and training built on the server's public modules."""

from __future__ import annotations

import ast
from collections.abc import Collection
from pathlib import Path

import pytest

from tests.unit.test_layering import imports

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "server" / "halfserve"
MAX_LINES = 600
"""A module past this holds more than one idea: give each its own file before adding the next."""
STILL_OVER: dict[str, int] = {}
"""Modules over :data:`MAX_LINES` while their split is under way, each with its line count when listed: it may only
shrink, and leaves this list once under the limit."""


def defined_names(path: Path) -> set[str]:
    """The names a module defines at its top level (functions, classes, assignments), not those it imports."""
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


def test_no_module_is_over_the_limit() -> None:
    counts = {str(p.relative_to(PKG)): len(p.read_text().splitlines()) for p in sorted(PKG.rglob("*.py"))}
    over = {path: n for path, n in counts.items() if n > MAX_LINES and n > STILL_OVER.get(path, 0)}
    assert not over, f"over {MAX_LINES} lines (split them): {over}"
    done = sorted(path for path in STILL_OVER if counts.get(path, 0) <= MAX_LINES)
    assert not done, f"under {MAX_LINES} lines now: take them off STILL_OVER: {done}"


ONE_PATH = (
    "halfserve.manifest",
    "halfserve.storage",
    "halfserve.store",
    "halfserve.packing",
    "halfserve.batching",
    "halfserve.batchcut",
    "halfserve.precision",
    "halfserve.serving",
    "halfserve.errors",
)
"""Modules whose names are imported from where they are defined only: none of them re-exports another's (the
batcher re-exported the contract's errors, the store the manifest's names, the precision policy the manifest's
``Precision``); the serving contract imports the domain errors it raises, and none is taken from it."""


def importing_files() -> list[Path]:
    return sorted(
        p for top in ("server", "tests", "benchmarks", "scripts", "examples") for p in (ROOT / top).rglob("*.py")
    )


def taken_names(tree: ast.Module, modules: Collection[str]) -> list[tuple[str, str]]:
    """``(module, name)`` for each name of one of ``modules`` that ``tree`` takes: ``from module import name``, and
    ``alias.name`` where the module itself is bound to ``alias`` (``from halfserve import precision``,
    ``import halfserve.precision as precision``)."""
    taken: list[tuple[str, str]] = []
    aliases: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module in modules:
            taken += [(node.module, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            aliases.update(
                {
                    a.asname or a.name: f"{node.module}.{a.name}"
                    for a in node.names
                    if f"{node.module}.{a.name}" in modules
                }
            )
        elif isinstance(node, ast.Import):
            aliases.update({a.asname: a.name for a in node.names if a.asname and a.name in modules})
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            taken.append((aliases[node.value.id], node.attr))
    return taken


def test_each_name_is_imported_from_where_it_is_defined() -> None:
    defined = {m: defined_names(PKG / (m.removeprefix("halfserve.") + ".py")) for m in ONE_PATH}
    wrong = [
        f"{path.relative_to(ROOT)}: {module}.{name}"
        for path in importing_files()
        for module, name in taken_names(ast.parse(path.read_text()), defined)
        if name not in defined[module]
    ]
    assert not wrong, wrong


def test_the_store_re_exports_nothing() -> None:
    tree = ast.parse((PKG / "store.py").read_text())
    exported = next(
        ast.literal_eval(node.value)
        for node in tree.body
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)
    )
    assert set(exported) <= defined_names(PKG / "store.py")


def test_the_management_routes_ask_the_contract_not_the_disk() -> None:
    """``api/admin.py`` lists and loads models through ``ModelAdmin``: of the store's modules it takes the error alone,
    and it reads no folder itself."""
    tree = ast.parse((PKG / "api" / "admin.py").read_text())
    taken = {
        f"{node.module}.{a.name}"
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module
        for a in node.names
    }
    store_names = {t for t in taken if t.startswith(("halfserve.storage.", "halfserve.store."))}
    assert store_names == {"halfserve.storage.StoreError"}
    assert "halfserve.storage" not in taken
    assert not any(t.startswith("pathlib.") for t in taken)


ENGINE_INSIDES = (
    "halfserve.engine",
    "halfserve.instance",
    "halfserve.placement",
    "halfserve.records",
    "halfserve.compilation",
)
"""The engine's own modules: the load test and training use the server's public ones (precision, manifest, store)."""


@pytest.mark.parametrize("package", ["loadtest", "training"])
def test_the_load_test_and_training_import_no_engine_insides(package: str) -> None:
    offenders = {
        str(path.relative_to(PKG)): sorted(i for i in imports(path) if i.startswith(ENGINE_INSIDES))
        for path in sorted((PKG / package).rglob("*.py"))
    }
    assert not {k: v for k, v in offenders.items() if v}


def test_the_load_test_restates_no_precision_or_datatype_names() -> None:
    """Collections of the server's precision or datatype names are taken from ``Precision`` and ``DataType``."""
    from halfserve.manifest import DataType, Precision

    vocabularies = ({p.value for p in Precision}, {t.value for t in DataType})
    restated = []
    for path in sorted((PKG / "loadtest").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Tuple | ast.List | ast.Set) and len(node.elts) >= 2:
                values = {e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)}
                if len(values) == len(node.elts) and any(values <= names for names in vocabularies):
                    restated.append(f"{path.relative_to(PKG)}:{node.lineno}: {sorted(values)}")
    assert not restated, restated
