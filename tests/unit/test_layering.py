"""The one-way arrows between the server's parts (docs/architecture.md), read from the imports of every module and
checked again by what each layer loads.

Routes (``halfserve.api``) sit on top: below them nothing imports them, except the app that assembles them and the
multi-process package, which reaches them through the HTTP transport's one public entry (``halfserve.api.http``
itself, never a route module). The batcher is pure asyncio: neither torch nor FastAPI. The serving contract is
neutral: neither HTTP nor torch. The data plane (``halfserve.api.dataplane``) knows no transport: neither FastAPI,
Starlette, uvicorn nor gRPC, nor torch, nor the batcher. HTTP (``halfserve.api.http``) and gRPC
(``halfserve.api.grpc``) are a folder each, and gRPC loads nothing of HTTP's; what they share
(``halfserve.api.errors``, ``access``, ``lockout``, ``admin``) is neither. The two process families (front-ends,
instance processes) share ``halfserve.ipc`` and not each other's code.

The import lists see one step; a fresh interpreter per layer (:data:`LAYERS`) sees every step, so a helper imported
from a route module, or a type's module that loads an implementation, fails the layer that reaches it.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import NamedTuple

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
    assert {"halfserve.serving", "halfserve.batching", "halfserve.api.http", "halfserve.multiproc.frontend"} <= set(
        MODULES
    )
    assert "halfserve.serving" in MODULES["halfserve.api.http.v2"]  # the reader sees `from halfserve.serving import`


def test_nothing_below_the_routes_imports_them() -> None:
    allowed = {"halfserve.app"}  # the composition root: it builds the app from the routes
    offenders = {
        name: found
        for name, found in importers_of("halfserve.api").items()
        if not name.startswith(("halfserve.api", "halfserve.multiproc")) and name not in allowed
    }
    assert not offenders, offenders


def test_the_multiprocess_package_reaches_the_routes_only_through_their_public_entry() -> None:
    route_modules = {name for name in MODULES if name.startswith("halfserve.api.")} - {"halfserve.api.http"}
    for name, found in importers_of("halfserve.api").items():
        if name.startswith("halfserve.multiproc"):
            assert not found & route_modules, f"{name} imports a route module: {sorted(found & route_modules)}"
    import halfserve.api.http

    # What it takes from halfserve.api.http is that package's declared public surface.
    for name, found in importers_of("halfserve.api").items():
        if name.startswith("halfserve.multiproc"):
            names = {i.removeprefix("halfserve.api.http.") for i in found if i.startswith("halfserve.api.http.")}
            assert names <= set(halfserve.api.http.__all__), names - set(halfserve.api.http.__all__)


@pytest.mark.parametrize("module", ["halfserve.batching", "halfserve.serving", "halfserve.errors"])
def test_the_batcher_and_the_contract_import_neither_torch_nor_http(module: str) -> None:
    banned = ("torch", "fastapi", "starlette", "uvicorn", "httpx")
    found = {i for i in MODULES[module] if i.split(".")[0] in banned}
    assert not found, found


PROCESS_FAMILIES = ("halfserve.multiproc", "halfserve.isolated")
"""Front-end processes with their engine process, and instance processes: each speaks ``halfserve.ipc``."""


@pytest.mark.parametrize(("family", "other"), [PROCESS_FAMILIES, PROCESS_FAMILIES[::-1]])
def test_the_two_process_families_do_not_import_each_other(family: str, other: str) -> None:
    members = {name: found for name, found in MODULES.items() if _under(name, (family,))}
    assert members, family
    offenders = {name: sorted(i for i in found if _under(i, (other,))) for name, found in members.items()}
    assert not any(offenders.values()), offenders


def test_the_process_package_imports_no_process_family_no_transport_and_no_torch() -> None:
    package = {name: found for name, found in MODULES.items() if _under(name, ("halfserve.ipc",))}
    assert {"halfserve.ipc.frames", "halfserve.ipc.memory", "halfserve.ipc.channel"} <= set(package)
    banned = ("torch", "fastapi", "starlette", "uvicorn", "grpc", "httpx")
    for name, found in package.items():
        wrong = {i for i in found if i.split(".")[0] in banned or _under(i, PROCESS_FAMILIES)}
        assert not wrong, f"{name}: {sorted(wrong)}"


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
    # Only its own errors' module, which imports nothing of the server's; the rest under TYPE_CHECKING, for annotations.
    assert top_level <= {"halfserve.errors"}, top_level
    assert not {i for i in MODULES["halfserve.errors"] if i.startswith("halfserve")}


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


def _under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


TRANSPORTS = ("halfserve.api.http", "halfserve.api.grpc")
"""The transports, each a folder of its own: every module under them is theirs, found rather than listed."""


def test_each_transport_is_a_folder_and_the_api_package_loads_nothing() -> None:
    for transport in TRANSPORTS:
        assert {n for n in MODULES if _under(n, (transport,))} - {transport}, transport
    body = ast.parse((ROOT / "api" / "__init__.py").read_text()).body
    assert [type(node) for node in body] == [ast.Expr], "halfserve.api holds a docstring only"


def test_the_data_plane_knows_no_transport_and_no_route() -> None:
    plane = {name: found for name, found in MODULES.items() if name.startswith("halfserve.api.dataplane")}
    assert {"halfserve.api.dataplane.decode", "halfserve.api.dataplane.infer", "halfserve.api.dataplane.encode"} <= set(
        plane
    )
    for name, found in plane.items():
        transports = {i for i in found if i.split(".")[0] in ("fastapi", "starlette", "grpc", "uvicorn")}
        routes = {i for i in found if _under(i, TRANSPORTS)}
        assert not transports | routes, f"{name}: {sorted(transports | routes)}"


def test_grpc_infers_through_the_data_plane_and_knows_no_http() -> None:
    grpc = {name: found for name, found in MODULES.items() if _under(name, ("halfserve.api.grpc",))}
    assert len(grpc) > 1, sorted(grpc)
    for name, found in grpc.items():
        http = {i for i in found if _under(i, ("halfserve.api.http",)) or i.split(".")[0] in ("fastapi", "starlette")}
        assert not http, f"{name}: {sorted(http)}"
    for name in ("halfserve.api.grpc.grpc_service", "halfserve.api.grpc.grpc_codec"):
        assert {i for i in MODULES[name] if i.startswith("halfserve.api.dataplane")}, name


# What each layer loads, not only what it names: a fresh interpreter imports the layer's modules and reports what
# came with them. An import three modules down (the data plane through a route module's helper, the routes through
# a type's module) shows here, where the import lists above see only the first step.


class Layer(NamedTuple):
    """Modules imported together in a fresh interpreter, and the modules none of them may load."""

    modules: tuple[str, ...]
    banned: tuple[str, ...]
    named: bool = True
    """Whether the modules may not name a banned module in any import either, inside a function or under
    ``TYPE_CHECKING`` included (a lazy import the fresh interpreter does not see)."""


LAYERS: dict[str, Layer] = {
    "data plane": Layer(
        tuple(sorted(n for n in MODULES if _under(n, ("halfserve.api.dataplane",)))),
        ("fastapi", "starlette", "uvicorn", "grpc", "torch", "halfserve.batching"),
    ),
    "gRPC": Layer(
        tuple(sorted(n for n in MODULES if _under(n, ("halfserve.api.grpc",)))),
        ("fastapi", "starlette", "uvicorn", "torch", "halfserve.batching", "halfserve.api.http"),
    ),
    "serving contract": Layer(("halfserve.serving", "halfserve.errors"), ("fastapi", "torch")),
    "batcher": Layer(("halfserve.batching",), ("torch", "fastapi")),
    "routes": Layer(
        tuple(sorted(n for n in MODULES if _under(n, ("halfserve.api",)))),
        ("torch", "halfserve.batching"),
    ),
    "front-ends": Layer(
        (
            "halfserve.api.http",
            "halfserve.api.grpc.grpc_service",
            "halfserve.multiproc.frontend",
            "halfserve.multiproc.client",
        ),
        ("torch", "halfserve.repository", "halfserve.store"),
    ),
    # A front-end spawned from the halfserve script imports the script, and so the command line, again; its serve
    # command imports the repository when it runs, inside a function.
    "command line": Layer(("halfserve.cli",), ("torch", "halfserve.repository", "halfserve.store"), named=False),
    "process package": Layer(tuple(sorted(n for n in MODULES if _under(n, ("halfserve.ipc",)))), ("torch",)),
    "torch-free store modules": Layer(
        ("halfserve.storage", "halfserve.manifest", "halfserve.packing", "halfserve.batchcut"),
        ("torch", "safetensors", "halfserve.store"),
    ),
    # The settings name the placement decision's values: a process that reads its settings loads no engine.
    "placement decision": Layer(("halfserve.placement",), ("torch", "halfserve.store")),
}
"""Each layer, or module whose users rely on what it does not load: its modules (the data plane, the routes and the
process package found by their folders, not listed) and the modules none of them may load. The one table of what a
module may load: a rule of that kind goes here as a row."""

_PROBE = """
import importlib, json, sys
modules, banned = json.loads(sys.argv[1]), json.loads(sys.argv[2])
loaded_by = {}
for module in modules:
    importlib.import_module(module)
    loaded_by.update({b: module for b in banned if b in sys.modules and b not in loaded_by})
print(json.dumps(loaded_by))
"""
"""Imports each module in turn and names, for each banned module, the first one after whose import it was loaded."""


@pytest.fixture(scope="module")
def loaded_by() -> dict[str, dict[str, str]]:
    """For each layer, which of its banned modules its modules loaded, and which module loaded each: one interpreter
    per layer, all started at once."""
    import json
    import subprocess
    import sys

    probes = {
        layer: subprocess.Popen(
            [sys.executable, "-c", _PROBE, json.dumps(modules), json.dumps(banned)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for layer, (modules, banned, _) in LAYERS.items()
    }
    found: dict[str, dict[str, str]] = {}
    for layer, probe in probes.items():
        out, err = probe.communicate(timeout=120)
        assert probe.returncode == 0, f"{layer}: {err}"
        found[layer] = json.loads(out)
    return found


def test_the_layers_are_found() -> None:
    assert {"halfserve.api.dataplane.decode", "halfserve.api.dataplane.infer"} <= set(LAYERS["data plane"].modules)
    assert {"halfserve.api", "halfserve.api.http.v2", "halfserve.api.http.predict"} <= set(LAYERS["routes"].modules)
    assert {"halfserve.ipc.frames", "halfserve.ipc.memory", "halfserve.ipc.channel"} <= set(
        LAYERS["process package"].modules
    )


@pytest.mark.parametrize("layer", LAYERS)
def test_a_layer_loads_none_of_what_sits_beside_or_above_it(layer: str, loaded_by: dict[str, dict[str, str]]) -> None:
    assert loaded_by[layer] == {}, f"{layer} loads {loaded_by[layer]} (banned module: the module that loaded it)"


@pytest.mark.parametrize("layer", [name for name, layer in LAYERS.items() if layer.named])
def test_a_layer_names_none_of_what_it_may_not_load(layer: str) -> None:
    modules, banned, _ = LAYERS[layer]
    named = {m: sorted(i for i in MODULES[m] if _under(i, banned)) for m in modules}
    assert not any(named.values()), f"{layer} names { ({m: found for m, found in named.items() if found}) }"
