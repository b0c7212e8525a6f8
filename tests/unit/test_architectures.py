"""Architectures from outside the package: ``module:factory`` from the operator's folder, entry points, torchvision and
Hugging Face folders; every failure named with the manifest's file and field."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from halfserve import models, storage, store
from halfserve.engine.core import Engine
from halfserve.manifest import Manifest, Precision, TensorSpec
from halfserve.repository import ModelRepository
from halfserve.settings import Settings
from halfserve.storage import StoreError

ROOT = Path(__file__).resolve().parents[2]

CPU = torch.device("cpu")


@pytest.fixture
def code_dir(tmp_path: Path) -> Iterator[Path]:
    """A folder of the operator's code, on the import path for the test only."""
    folder = tmp_path / "code"
    folder.mkdir()
    before = list(sys.path)
    yield folder
    sys.path[:] = before
    for name in [m for m in sys.modules if m.startswith("opcode_")]:
        del sys.modules[name]


def write_module(folder: Path, name: str, body: str) -> None:
    (folder / f"{name}.py").write_text(textwrap.dedent(body))
    importlib.invalidate_caches()


NET = """
    import torch
    from torch import nn

    class Net(nn.Module):
        def __init__(self, width: int = 4, classes: int = 3) -> None:
            super().__init__()
            self.body = nn.Linear(width, 8)
            self.head = nn.Linear(8, classes)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(torch.relu(self.body(x)))

    def build(width: int = 4, classes: int = 3) -> nn.Module:
        return Net(width, classes)

    NOT_CALLABLE = 3

    def not_a_module() -> int:
        return 7
"""


def manifest(architecture: str, **fields: object) -> Manifest:
    return Manifest.model_validate(
        {
            "name": "net",
            "architecture": architecture,
            "arch_kwargs": {"width": 4, "classes": 3},
            "inputs": [TensorSpec(name="x", shape=[4])],
            "outputs": [TensorSpec(name="y", shape=[3])],
            **fields,
        }
    )


def test_a_factory_from_the_operators_folder_saves_loads_and_serves(code_dir: Path, tmp_path: Path) -> None:
    write_module(code_dir, "opcode_net", NET)
    models.add_code_path([code_dir])
    module = models.build("opcode_net:build", width=4, classes=3)
    store.save(tmp_path / "store", manifest("opcode_net:build"), module)
    loaded = store.load(tmp_path / "store", "net")
    x = np.random.default_rng(0).standard_normal((5, 4)).astype(np.float32)
    with torch.inference_mode():
        want = module(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(loaded.module(torch.from_numpy(x)).detach().numpy(), want, rtol=1e-6)
    engine = Engine(loaded, Precision.BF16, CPU)
    np.testing.assert_allclose(engine.forward(x), want, atol=0.05 * np.abs(want).max())
    engine.close()


@pytest.mark.parametrize(
    ("architecture", "message"),
    [
        ("opcode_absent:build", "module 'opcode_absent' not found (is its folder given with --code-path?)"),
        ("opcode_net:missing", "module has no attribute 'missing'"),
        ("opcode_net:NOT_CALLABLE", "int object is not callable"),
        ("opcode_net:not_a_module", "returned int, not a torch.nn.Module"),
    ],
)
def test_each_architecture_failure_is_named_before_serving(
    code_dir: Path, tmp_path: Path, architecture: str, message: str
) -> None:
    write_module(code_dir, "opcode_net", NET)
    models.add_code_path([code_dir])
    root = tmp_path / "store"
    store.save(root, manifest("opcode_net:build"), models.build("opcode_net:build"))
    broken = manifest(architecture, arch_kwargs={})
    store.write_manifest(root, broken)
    with pytest.raises(StoreError) as caught:
        ModelRepository(Settings(store=root)).discover()  # what `halfserve serve` runs before it binds the port
    assert str(root / "net" / "config.json") in str(caught.value)
    assert "architecture: " in str(caught.value)
    assert message in str(caught.value)


def test_a_checkpoint_that_does_not_fit_names_missing_and_unexpected_tensors(code_dir: Path, tmp_path: Path) -> None:
    write_module(code_dir, "opcode_net", NET)
    models.add_code_path([code_dir])
    root = tmp_path / "store"
    vdir = store.save(root, manifest("opcode_net:build"), models.build("opcode_net:build"))
    other = {"body.weight": torch.zeros(8, 4), "body.bias": torch.zeros(8), "extra.weight": torch.zeros(1)}
    save_file(other, str(vdir / storage.WEIGHTS))
    expected = "missing: head.bias, head.weight; unexpected: extra.weight"
    with pytest.raises(StoreError, match=expected):
        ModelRepository(Settings(store=root)).discover()
    with pytest.raises(StoreError, match=expected):
        store.load(root, "net")


def test_arch_kwargs_that_do_not_fit_are_named(code_dir: Path, tmp_path: Path) -> None:
    write_module(code_dir, "opcode_net", NET)
    models.add_code_path([code_dir])
    root = tmp_path / "store"
    store.save(root, manifest("opcode_net:build"), models.build("opcode_net:build"))
    store.write_manifest(root, manifest("opcode_net:build", arch_kwargs={"depth": 3}))
    with pytest.raises(StoreError, match=r"config.json: arch_kwargs: .*depth"):
        ModelRepository(Settings(store=root)).discover()


@pytest.mark.parametrize("name", ["not a name", "x:", ":y", "torchvision:", "pkg.mod:fn()", "nosuchregistered"])
def test_names_of_no_architecture_form_are_refused_at_validation(name: str) -> None:
    with pytest.raises(ValueError, match="architecture"):
        manifest(name)


def test_a_code_path_that_is_no_folder_is_refused(tmp_path: Path) -> None:
    with pytest.raises(models.UnknownArchitectureError, match="is not a folder"):
        models.add_code_path([tmp_path / "absent"])


def test_settings_take_several_code_paths_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HALFSERVE_CODE_PATH", "/a/b:/c")
    assert Settings().code_path == [Path("/a/b"), Path("/c")]


def test_installed_packages_register_architectures_by_entry_point(code_dir: Path) -> None:
    write_module(code_dir, "opcode_plugin", NET)
    info = code_dir / "opcode_plugin-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: opcode-plugin\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[halfserve.architectures]\nplugnet = opcode_plugin:build\n")
    sys.path.insert(0, str(code_dir))
    importlib.invalidate_caches()
    assert "plugnet" in models.names()
    assert manifest("plugnet").architecture == "plugnet"
    built = models.build("plugnet", width=4, classes=3)
    assert isinstance(built, nn.Module)
    assert built.head.out_features == 3


def torchvision_importable() -> str | None:
    try:
        import torchvision.models  # noqa: F401
    except Exception as e:  # the PyPI wheel needs CUDA torch's libraries: it does not import with a CPU build
        return f"torchvision does not import here ({type(e).__name__}: {e})"
    return None


def test_torchvision_builders_build_with_random_weights() -> None:
    reason = torchvision_importable()
    if reason is not None:
        with pytest.raises(models.UnknownArchitectureError, match="torchvision"):
            models.build("torchvision:resnet18", num_classes=10)
        pytest.skip(reason + "; its refusal is named, as checked")
    module = models.build("torchvision:resnet18", num_classes=10)
    assert module.fc.out_features == 10
    with pytest.raises(models.UnknownArchitectureError, match="no model builder 'resnet_nope'"):
        models.resolve("torchvision:resnet_nope")


def test_the_torchvision_install_command_pairs_it_with_this_torch() -> None:
    release = torch.__version__.split("+")[0]
    minor, patch = int(release.split(".")[1]), release.split(".")[2]
    command = models.torchvision_install()
    # Forced: PyPI's torchvision (the one that does not import) has the same version, so pip would keep it.
    assert command.startswith(f"pip install --force-reinstall --no-deps torchvision==0.{minor + 15}.{patch}")
    index = "cpu" if torch.version.cuda is None else "cu" + torch.version.cuda.replace(".", "")
    assert command.endswith(f" --index-url https://download.pytorch.org/whl/{index}")


def broken_torchvision(folder: Path) -> dict[str, str]:
    """An installed torchvision whose import fails as PyPI's Linux wheel does beside a CPU-only torch (its C++
    operators are built for the CUDA torch): a package and its metadata on the path of the processes run with the
    environment returned."""
    (folder / "torchvision").mkdir(parents=True)
    (folder / "torchvision" / "__init__.py").write_text(
        'raise RuntimeError("operator torchvision::nms does not exist")\n'
    )
    (folder / "torchvision-0.28.0.dist-info").mkdir()
    (folder / "torchvision-0.28.0.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: torchvision\nVersion: 0.28.0\n"
    )
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(folder), str(ROOT / "server"), str(ROOT)])}


def test_a_broken_torchvision_fails_its_architectures_in_one_line_and_hugging_face_models_still_import(
    tmp_path: Path,
) -> None:
    pytest.importorskip("transformers")
    env = broken_torchvision(tmp_path / "site")
    torch.save(models.build("small_cnn", in_channels=3).state_dict(), tmp_path / "cnn.pth")

    def halfserve(*args: str) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "halfserve", "import", *args, "--store", str(tmp_path / "store"), "--samples", "4"]
        return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, check=False)

    vision = halfserve(str(tmp_path / "cnn.pth"), "--name", "r", "--architecture", "torchvision:resnet18",
                       "--input", "image:FP32:3x32x32")  # fmt: skip
    assert vision.returncode == 2, vision.stderr
    (line,) = vision.stderr.splitlines()
    assert "torchvision is installed but does not import with this torch" in line
    assert "operator torchvision::nms does not exist" in line
    assert line.endswith(models.torchvision_install())
    assert "config.json" not in line  # no manifest is named: none is written yet
    folder = tmp_path / "tiny_bert"
    done = subprocess.run([sys.executable, str(ROOT / "examples" / "hf_classifier" / "make_model.py"), str(folder)],
                          capture_output=True, text=True, timeout=300, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr
    text = halfserve(str(folder), "--name", "tb", "--architecture", "transformers:AutoModelForSequenceClassification",
                     "--input", "input_ids:INT64:16")  # fmt: skip
    assert text.returncode == 0, text.stderr
    assert "outputs logits FP32 [3]" in text.stdout


def test_the_torchvision_example_fails_in_one_line_with_the_command_that_fixes_it(tmp_path: Path) -> None:
    example = ROOT / "examples" / "torchvision_resnet18" / "save_state_dict.py"
    env = broken_torchvision(tmp_path / "site")
    done = subprocess.run([sys.executable, str(example), str(tmp_path / "out")],
                          capture_output=True, text=True, env=env, timeout=300, check=False)  # fmt: skip
    assert done.returncode == 1
    (line,) = done.stderr.splitlines()
    assert line.startswith("save_state_dict.py: torchvision does not import (RuntimeError: operator torchvision::nms")
    assert line.endswith(models.torchvision_install())
    assert not (tmp_path / "out").exists()


def test_an_architecture_under_the_packages_old_name_is_refused_with_its_new_name() -> None:
    with pytest.raises(models.UnknownArchitectureError) as refused:
        models.resolve("server.models.mlp:MLP")
    assert "the package 'server' is now 'halfserve': write 'halfserve.models.mlp:MLP'" in str(refused.value)
    assert models.resolve("halfserve.models.mlp:MLP") is models.resolve("mlp")
