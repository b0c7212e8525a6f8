"""The one-way arrows between the server's parts (docs/architecture.md), read from the imports of every module.

Routes (``server.api``) sit on top: below them nothing imports them, except the app that assembles them and the
multi-process package, which reaches them through their one public entry (``server.api`` itself, never a route
module). The batcher is pure asyncio: neither torch nor FastAPI. The serving contract is neutral: neither HTTP nor
torch.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "server"


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
    assert {"server.serving", "server.batching", "server.api", "server.multiproc.frontend"} <= set(MODULES)
    assert "server.serving" in MODULES["server.api.v2"]  # the reader sees `from server.serving import ...`


def test_nothing_below_the_routes_imports_them() -> None:
    allowed = {"server.app"}  # the composition root: it builds the app from the routes
    offenders = {
        name: found
        for name, found in importers_of("server.api").items()
        if not name.startswith(("server.api", "server.multiproc")) and name not in allowed
    }
    assert not offenders, offenders


def test_the_multiprocess_package_reaches_the_routes_only_through_their_public_entry() -> None:
    route_modules = {name for name in MODULES if name.startswith("server.api.")}
    for name, found in importers_of("server.api").items():
        if name.startswith("server.multiproc"):
            assert not found & route_modules, f"{name} imports a route module: {sorted(found & route_modules)}"
    import server.api

    # What it takes from server.api is that package's declared public surface.
    for name, found in importers_of("server.api").items():
        if name.startswith("server.multiproc"):
            names = {i.removeprefix("server.api.") for i in found if i.startswith("server.api.")}
            assert names <= set(server.api.__all__), names - set(server.api.__all__)


@pytest.mark.parametrize("module", ["server.batching", "server.serving"])
def test_the_batcher_and_the_contract_import_neither_torch_nor_http(module: str) -> None:
    banned = ("torch", "fastapi", "starlette", "uvicorn", "httpx")
    found = {i for i in MODULES[module] if i.split(".")[0] in banned}
    assert not found, found


def test_the_batcher_sits_below_the_repository_and_the_engine() -> None:
    assert not {i for i in MODULES["server.batching"] if i.startswith(("server.repository", "server.engine"))}
    assert not {i for i in MODULES["server.engine"] if i.startswith("server.batching")}  # its contract is serving's


def test_the_serving_contract_imports_no_implementation_at_run_time() -> None:
    tree = ast.parse((ROOT / "serving.py").read_text())
    top_level = {
        node.module
        for node in tree.body
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("server")
    }
    assert not top_level, top_level  # only under TYPE_CHECKING, for annotations


ROUTE_MODULES = ("server.api.v2", "server.api.v2_repository", "server.api.v2_triton", "server.api.predict")
"""The HTTP route modules: their helpers are for their own routes, not for another protocol's."""


def _under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def test_the_data_plane_knows_no_transport_and_no_route() -> None:
    plane = {name: found for name, found in MODULES.items() if name.startswith("server.api.dataplane")}
    assert {"server.api.dataplane.decode", "server.api.dataplane.infer", "server.api.dataplane.encode"} <= set(plane)
    for name, found in plane.items():
        transports = {i for i in found if i.split(".")[0] in ("fastapi", "starlette", "grpc", "uvicorn")}
        routes = {i for i in found if _under(i, (*ROUTE_MODULES, "server.api.grpc_service", "server.api.grpc_codec"))}
        assert not transports | routes, f"{name}: {sorted(transports | routes)}"


def test_grpc_infers_through_the_data_plane_not_the_http_route() -> None:
    for name in ("server.api.grpc_service", "server.api.grpc_codec"):
        assert not {i for i in MODULES[name] if _under(i, ("server.api.v2", "server.api.predict"))}, name
        assert {i for i in MODULES[name] if i.startswith("server.api.dataplane")}, name
