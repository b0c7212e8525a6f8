"""A ``module:factory`` architecture names a function or class defined in that module, by its plain name: the walk
through what the module imports (``halfserve.models:torch.load``) reached any library function with the manifest's
``arch_kwargs``, so a model folder alone ran a pickle, a ``hubconf.py``, a shared library's constructor, or
``sys.exit`` (``serve`` then ended with status 0 and no word). Of halfserve's own models only the registered
architectures may be named, of an entry point's module only its declared factory, and whatever a factory raises,
``SystemExit`` included, fails that model alone."""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from halfserve import importer, models
from halfserve.manifest import TensorSpec
from halfserve.settings import Settings
from halfserve.storage import StoreError
from tests.conftest import save_tiny_mlp
from tests.security.test_model_code import started, write_hostile

ROOT = Path(__file__).resolve().parents[2]
PLAIN_NAME = "the part after ':' must be the plain name of a function or class defined in"


class Payload:
    """Unpickling it runs ``touch <marker>``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str, ...]]:
        return (os.system, (f"touch {self.marker}",))


def shared_library(folder: Path, marker: Path) -> Path:
    """A ``.so`` whose constructor writes ``marker``; a file that is none when no C compiler is at hand (the string is
    refused before anything is called either way)."""
    library = folder / "libpayload.so"
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        library.write_bytes(b"not a library")
        return library
    source = folder / "payload.c"
    source.write_text(
        "#include <stdio.h>\n"
        "__attribute__((constructor)) static void ran(void) {\n"
        f'  FILE *f = fopen("{marker}", "w"); if (f) fclose(f);\n'
        "}\n"
    )
    subprocess.run([compiler, "-shared", "-fPIC", "-o", str(library), str(source)], check=True, timeout=120)
    return library


def payloads(folder: Path, marker: Path) -> dict[str, tuple[str, dict[str, object]]]:
    """Each architecture string that ran code from ``folder`` (a model's version folder), writing ``marker``."""
    folder.mkdir(parents=True, exist_ok=True)
    pickle = folder / "weights.pt"
    torch.save({"state": Payload(marker)}, str(pickle))
    hub = folder / "hub"
    hub.mkdir(exist_ok=True)
    (hub / "hubconf.py").write_text(f"import pathlib\npathlib.Path({str(marker)!r}).touch()\n")
    return {
        "torch.load": ("halfserve.models:torch.load", {"f": str(pickle), "weights_only": False}),
        "torch.hub.load": (
            "halfserve.models:torch.hub.load",
            {"repo_or_dir": str(hub), "model": "net", "source": "local"},
        ),
        "load_library": ("halfserve.models:torch.ops.load_library", {"path": str(shared_library(folder, marker))}),
        "submodule": ("halfserve.models.mlp:torch.load", {"f": str(pickle), "weights_only": False}),
        "sys.exit": ("halfserve.models:sys.exit", {}),
    }


KINDS = ["torch.load", "torch.hub.load", "load_library", "submodule", "sys.exit"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_path_through_a_modules_imports_is_refused_at_import(tmp_path: Path, kind: str) -> None:
    marker = tmp_path / "ran"
    architecture, kwargs = payloads(tmp_path / "source", marker)[kind]
    weights = tmp_path / "w.safetensors"
    save_file({"w": torch.zeros(1)}, str(weights))
    with pytest.raises(StoreError, match=PLAIN_NAME):
        importer.import_model(
            weights, tmp_path / "store", "evil", architecture, [TensorSpec(name="x", shape=[4])], arch_kwargs=kwargs
        )
    assert not marker.exists()
    assert not (tmp_path / "store" / "evil").exists()


@pytest.mark.parametrize("kind", ["torch.load", "torch.hub.load", "load_library", "submodule"])
async def test_a_path_through_a_modules_imports_fails_that_model_at_load_and_runs_nothing(
    tmp_path: Path, kind: str
) -> None:
    root = tmp_path / "store"
    save_tiny_mlp(root)
    marker = tmp_path / "ran"
    architecture, kwargs = payloads(root / "evil" / "1", marker)[kind]  # what the model folder ships
    write_hostile(root, "evil", architecture, kwargs)
    async with started(Settings(store=root), "tiny") as client:
        assert (await client.get("/v2/models/evil/ready")).status_code != 200
        evil = await client.post("/predict", json={"model": "evil", "inputs": [[0, 0, 0, 0]]})
        assert evil.status_code in (404, 503), evil.text
        assert PLAIN_NAME in evil.text, evil.text
        ok = await client.post("/predict", json={"model": "tiny", "inputs": np.zeros((2, 16)).tolist()})
        assert ok.status_code == 200, ok.text
    assert not marker.exists()


def serve(root: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    """``halfserve serve`` on a store whose only model is refused: it ends before binding, naming why."""
    cmd = [sys.executable, "-m", "halfserve", "serve", "--store", str(root), "--port", "0", *flags]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300, check=False)


def test_sys_exit_named_by_a_manifest_does_not_end_serve_silently(tmp_path: Path) -> None:
    root = tmp_path / "store"
    architecture, kwargs = payloads(tmp_path / "source", tmp_path / "ran")["sys.exit"]
    write_hostile(root, "evil", architecture, kwargs)
    done = serve(root)
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert "Traceback" not in done.stderr, done.stderr
    assert PLAIN_NAME in done.stderr, done.stderr


EXITS = """
    def build() -> object:
        raise SystemExit(0)
"""


def test_a_factory_raising_system_exit_fails_its_model_not_the_server(tmp_path: Path) -> None:
    code = tmp_path / "code"
    code.mkdir()
    (code / "opcode_exits.py").write_text(textwrap.dedent(EXITS))
    root = tmp_path / "store"
    write_hostile(root, "exits", "opcode_exits:build", {})
    done = serve(root, "--code-path", str(code))
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert "Traceback" not in done.stderr, done.stderr
    assert "architecture: 'opcode_exits:build' failed to build: SystemExit: 0" in done.stderr, done.stderr


OPERATOR_MODULE = """
    import sys

    from torch import nn
    from torch.nn import Linear

    def build() -> nn.Module:
        return Linear(4, 2)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = Linear(4, 2)
"""


@pytest.fixture
def operator_code(tmp_path: Path) -> object:
    code = tmp_path / "code"
    code.mkdir()
    (code / "opcode_names.py").write_text(textwrap.dedent(OPERATOR_MODULE))
    (code / "opcode_quits.py").write_text("raise SystemExit(3)\n")
    before = list(sys.path)
    models.add_code_path([code])
    yield code
    sys.path[:] = before
    for module in ("opcode_names", "opcode_quits"):
        sys.modules.pop(module, None)


@pytest.mark.usefixtures("operator_code")
def test_an_operator_module_gives_only_what_it_defines() -> None:
    assert models.build("opcode_names:build").out_features == 2
    assert isinstance(models.build("opcode_names:Net"), torch.nn.Module)
    with pytest.raises(models.UnknownArchitectureError, match="'Linear' is not defined in module 'opcode_names'"):
        models.resolve("opcode_names:Linear")
    with pytest.raises(models.UnknownArchitectureError, match=PLAIN_NAME):
        models.resolve("opcode_names:sys.exit")
    with pytest.raises(models.UnknownArchitectureError, match=r"importing 'opcode_quits' failed: SystemExit: 3"):
        models.resolve("opcode_quits:build")


@pytest.mark.parametrize(
    "name", ["halfserve.models.registry:register", "halfserve.models:resolve", "halfserve.models:build"]
)
def test_of_halfserves_own_modules_only_registered_architectures_are_named(name: str) -> None:
    with pytest.raises(models.UnknownArchitectureError, match="only the registered architectures"):
        models.resolve(name)
    assert models.resolve("halfserve.models.mlp:MLP") is models.resolve("mlp")


def test_of_an_entry_points_module_only_its_declared_factory_is_named(tmp_path: Path) -> None:
    package = tmp_path / "site"
    package.mkdir()
    (package / "opcode_plugged.py").write_text(textwrap.dedent(OPERATOR_MODULE))
    info = package / "opcode_plugged-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: opcode-plugged\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[halfserve.architectures]\nplugged = opcode_plugged:build\n")
    before = list(sys.path)
    sys.path.append(str(package))  # installed, not a --code-path folder
    importlib.invalidate_caches()
    try:
        assert models.build("plugged").out_features == 2
        assert models.build("opcode_plugged:build").out_features == 2
        with pytest.raises(models.UnknownArchitectureError, match="name the entry point instead"):
            models.resolve("opcode_plugged:Net")
    finally:
        sys.path[:] = before
        sys.modules.pop("opcode_plugged", None)
