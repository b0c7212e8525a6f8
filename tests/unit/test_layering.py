"""The one-way arrows between the server's parts (docs/architecture.md), read from the imports of every module.

Routes (``halfserve.api``) sit on top: below them nothing imports them, except the app that assembles them and the
multi-process package, which reaches them through their one public entry (``halfserve.api`` itself, never a route
module). The batcher is pure asyncio: neither torch nor FastAPI. The serving contract is neutral: neither HTTP nor
torch.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "server" / "halfserve"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """Every module ``path`` imports, at its top or inside a function, under ``TYPE_CHECKING`` or not."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


MODULES = {module_name(p): imports(p) for p in sorted(ROOT.rglob("*.py"))}


def importers_of(prefix: str) -> dict[str, set[str]]:
    return {
        name: {i for i in found if i == prefix or i.startswith(prefix + ".")}
        for name, found in MODULES.items()
        if any(i == prefix or i.startswith(prefix + ".") for i in found)
    }


def test_the_modules_were_read() -> None:
    assert {"halfserve.serving", "halfserve.batching", "halfserve.api", "halfserve.multiproc.frontend"} <= set(MODULES)
    assert "halfserve.serving" in MODULES["halfserve.api.v2"]  # the reader sees `from halfserve.serving import ...`


def test_nothing_below_the_routes_imports_them() -> None:
    allowed = {"halfserve.app"}  # the composition root: it builds the app from the routes
    offenders = {
        name: found
        for name, found in importers_of("halfserve.api").items()
        if not name.startswith(("halfserve.api", "halfserve.multiproc")) and name not in allowed
    }
    assert not offenders, offenders


def test_the_multiprocess_package_reaches_the_routes_only_through_their_public_entry() -> None:
    route_modules = {name for name in MODULES if name.startswith("halfserve.api.")}
    for name, found in importers_of("halfserve.api").items():
        if name.startswith("halfserve.multiproc"):
            assert not found & route_modules, f"{name} imports a route module: {sorted(found & route_modules)}"
    import halfserve.api

    # What it takes from halfserve.api is that package's declared public surface.
    for name, found in importers_of("halfserve.api").items():
        if name.startswith("halfserve.multiproc"):
            names = {i.removeprefix("halfserve.api.") for i in found if i.startswith("halfserve.api.")}
            assert names <= set(halfserve.api.__all__), names - set(halfserve.api.__all__)


@pytest.mark.parametrize("module", ["halfserve.batching", "halfserve.serving"])
def test_the_batcher_and_the_contract_import_neither_torch_nor_http(module: str) -> None:
    banned = ("torch", "fastapi", "starlette", "uvicorn", "httpx")
    found = {i for i in MODULES[module] if i.split(".")[0] in banned}
    assert not found, found


def test_the_batcher_sits_below_the_repository_and_the_engine() -> None:
    assert not {i for i in MODULES["halfserve.batching"] if i.startswith(("halfserve.repository", "halfserve.engine"))}
    engine = {name: found for name, found in MODULES.items() if name.startswith("halfserve.engine")}
    assert "halfserve.engine.core" in engine
    assert not {i for found in engine.values() for i in found if i.startswith("halfserve.batching")}  # serving's


def test_the_serving_contract_imports_no_implementation_at_run_time() -> None:
    tree = ast.parse((ROOT / "serving.py").read_text())
    top_level = {
        node.module
        for node in tree.body
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("halfserve")
    }
    assert not top_level, top_level  # only under TYPE_CHECKING, for annotations


def module_edges(path: Path) -> set[str]:
    """The server modules ``path`` imports, each import as the module it names: ``from halfserve.api import lockout`` is
    an edge to ``halfserve.api.lockout``, ``from halfserve.manifest import Manifest`` one to ``halfserve.manifest``."""
    edges: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            edges.update(a.name for a in node.names if a.name in MODULES)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                if full in MODULES:
                    edges.add(full)
                elif node.module in MODULES:
                    edges.add(node.module)
    return edges - {module_name(path)}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, set())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_modules_import_each_other_in_a_cycle_type_checking_imports_included() -> None:
    graph = {module_name(p): module_edges(p) for p in sorted(ROOT.rglob("*.py"))}
    assert cycles(graph) == []


def test_routes_reach_models_only_through_the_contract() -> None:
    below = ("halfserve.repository", "halfserve.batching", "halfserve.engine", "halfserve.store", "halfserve.regions")
    for name, found in MODULES.items():
        if name.startswith("halfserve.api"):
            assert not {i for i in found if i.startswith(below)}, name


def test_the_routes_the_front_ends_and_the_grpc_service_import_no_torch() -> None:
    import subprocess
    import sys

    code = (
        # halfserve.cli too: a front-end spawned from the halfserve script imports the script, and so it, again.
        "import sys, halfserve.api, halfserve.api.grpc_service, halfserve.multiproc.frontend, "
        "halfserve.multiproc.client, halfserve.cli; "
        "print(sorted(m for m in ('torch', 'halfserve.repository', 'halfserve.store') if m in sys.modules))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert r.stdout.strip() == "[]"


ROUTE_MODULES = ("halfserve.api.v2", "halfserve.api.v2_repository", "halfserve.api.v2_triton", "halfserve.api.predict")
"""The HTTP route modules: their helpers are for their own routes, not for another protocol's."""


def _under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def test_the_data_plane_knows_no_transport_and_no_route() -> None:
    plane = {name: found for name, found in MODULES.items() if name.startswith("halfserve.api.dataplane")}
    assert {"halfserve.api.dataplane.decode", "halfserve.api.dataplane.infer", "halfserve.api.dataplane.encode"} <= set(
        plane
    )
    for name, found in plane.items():
        transports = {i for i in found if i.split(".")[0] in ("fastapi", "starlette", "grpc", "uvicorn")}
        routes = {
            i for i in found if _under(i, (*ROUTE_MODULES, "halfserve.api.grpc_service", "halfserve.api.grpc_codec"))
        }
        assert not transports | routes, f"{name}: {sorted(transports | routes)}"


def test_grpc_infers_through_the_data_plane_not_the_http_route() -> None:
    for name in ("halfserve.api.grpc_service", "halfserve.api.grpc_codec"):
        assert not {i for i in MODULES[name] if _under(i, ("halfserve.api.v2", "halfserve.api.predict"))}, name
        assert {i for i in MODULES[name] if i.startswith("halfserve.api.dataplane")}, name
