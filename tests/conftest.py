"""Shared fixtures: small real model stores and real server processes."""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing import shared_memory
from pathlib import Path

import httpx
import pytest
import torch
from torch._inductor.runtime.cache_dir_utils import default_cache_dir

from halfserve import models, store
from halfserve.engine.core import Engine
from halfserve.execution import Batching, Execution
from halfserve.imageinput import ColorMode, ImageInput
from halfserve.manifest import Manifest, Precision, TensorSpec

ROOT = Path(__file__).resolve().parent.parent

# The servers tests start (in-process apps and subprocesses alike, which inherit this) serve no gRPC unless a test
# asks for it with --grpc and a port of its own: several run side by side, and each would bind the default 8001.
os.environ["HALFSERVE_GRPC"] = "false"
# Their CPU models' threads and placement are decided from this made-up forward of a full batch (far shorter than
# the event loop's work on it: the tiny models' choice on a quiet host), not from one timed at warm-up, which
# decides otherwise on a loaded host. Tests of other timings give their own (forward_seconds, settle_threads).
os.environ["HALFSERVE_FORWARD_SECONDS"] = "1e-06"
# Torch's kernel cache stays where torch puts it, for every test and the servers they start: a server would otherwise
# move it into its store's compile cache (halfserve.compilecache.keep_kernels), each test's store a new and empty one.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())

PROCESS_ISOLATION = os.environ.get("HALFSERVE_PLACEMENT") == "instance_processes"
"""The suite runs with every engine's instances in processes of their own (.ci/run runs the integration tests so)."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not PROCESS_ISOLATION:
        return
    skip = pytest.mark.skip(reason="reaches into an engine's instance threads; instances run in processes here")
    for item in items:
        if item.get_closest_marker("instance_threads") is not None:
            item.add_marker(skip)


SHIPPED_STORE = ROOT / "model_store"
DIGITS_CNN_IMPORT = [
    "import",
    str(SHIPPED_STORE / "digits_cnn" / "1" / "model.safetensors"),
    "--architecture",
    "small_cnn",
    "--arch-kwargs",
    '{"in_channels": 1, "num_classes": 10, "width": 32}',
    "--input",
    "pixels:FP32:1x8x8",
]
"""``halfserve import`` of the shipped digits_cnn's weights (its architecture and input): a test adds the rest."""
DIGITS_PHOTO = ["--image", "image", "--image-mode", "L", "--image-resize", "8x8"]
"""The image section that feeds digits_cnn photos: grey, exactly 8x8, each pixel / 255 (the digits' 0..1)."""


needs_cxx = pytest.mark.skipif(
    not any(shutil.which(c) for c in ("g++", "c++", "clang++")),
    reason="TorchInductor builds C++ kernels on a CPU: needs a C++ compiler",
)
"""For tests of ``execution.compile: "inductor"`` on a CPU."""


def save_tiny_mlp(root: Path, name: str = "tiny", seed: int = 0, **manifest_fields: object) -> Path:
    """A small MLP with random weights, saved through the real store code."""
    torch.manual_seed(seed)
    kwargs = {"in_features": 16, "hidden": [32], "out_features": 4}
    module = models.build("mlp", **kwargs)
    fields: dict[str, object] = {
        "name": name,
        "architecture": "mlp",
        "arch_kwargs": kwargs,
        "inputs": [TensorSpec(name="features", shape=[16])],
        "outputs": [TensorSpec(name="logits", shape=[4])],
        "labels": ["a", "b", "c", "d"],
        "batching": Batching(max_batch_size=8, max_delay_ms=5),
    }
    fields.update(manifest_fields)
    return store.save(root, Manifest.model_validate(fields), module)


def save_photo_cnn(root: Path, name: str = "photo") -> Path:
    """A small CNN with random weights that takes photos as ``photo`` (grey, exactly 8x8) for its input ``pixels``,
    saved through the real store code."""
    torch.manual_seed(0)
    kwargs = {"in_channels": 1, "num_classes": 10, "width": 8}
    manifest = Manifest(
        name=name,
        architecture="small_cnn",
        arch_kwargs=kwargs,
        inputs=[TensorSpec(name="pixels", shape=[1, 8, 8])],
        outputs=[TensorSpec(name="logits", shape=[10])],
        image=ImageInput(input="photo", feeds="pixels", mode=ColorMode.L, resize=[8, 8]),
    )
    return store.save(root, manifest, models.build("small_cnn", **kwargs))


def tiny_engines(root: Path) -> tuple[Engine, Engine]:
    """The tiny MLP saved as ``tiny`` (one instance) and as ``pair`` (two), each on an fp32 CPU engine with a maximum
    batch of 8, not warmed up; the caller closes them."""
    save_tiny_mlp(root)
    save_tiny_mlp(root, "pair", execution=Execution(instances=2))
    cpu = torch.device("cpu")
    one = Engine(store.load(root, "tiny"), Precision.FP32, cpu, max_batch_size=8)
    return one, Engine(store.load(root, "pair"), Precision.FP32, cpu, max_batch_size=8)


OPERATOR_NET = textwrap.dedent(
    """
    from torch import nn

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.l = nn.Linear(6, 4)

        def forward(self, x):
            return self.l(x)

    def build() -> nn.Module:
        return Net()
    """
)
"""The source of a module of the operator's whose ``build`` gives a ``Linear(6, 4)`` (input [6], output [4]); a test
writes it under a module name of its own into :func:`operator_code`'s folder, and may edit it there."""


@pytest.fixture
def operator_code(tmp_path: Path) -> Iterator[Path]:
    """An empty --code-path folder of the operator's (``tmp_path/code``): the modules imported from it are forgotten
    afterwards, and ``sys.path`` is as it was before (a load or an import adds the folder to it)."""
    folder = tmp_path / "code"
    folder.mkdir()
    before = list(sys.path)
    yield folder
    sys.path[:] = before
    for name, module in list(sys.modules.items()):
        if Path(getattr(module, "__file__", None) or "/").is_relative_to(folder.resolve()):
            del sys.modules[name]


HALF_FAILS = "opcode_halffails"
"""A module of the operator's whose model runs in fp32 and raises in a half precision: its forward casts a boolean
input with ``.float()`` into weights of the half dtype."""


@pytest.fixture
def half_fails_code(operator_code: Path) -> Path:
    """A --code-path folder holding :data:`HALF_FAILS` (``opcode_halffails:build``: inputs ``ids`` INT64 [6] and
    ``keep`` BOOL [6], output [3]); its module is forgotten afterwards (:func:`operator_code`)."""
    (operator_code / f"{HALF_FAILS}.py").write_text(
        "from torch import nn\n\n\n"
        "class Net(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.emb, self.out = nn.Embedding(50, 8), nn.Linear(8, 3)\n\n"
        "    def forward(self, ids, keep):\n"
        "        return self.out((self.emb(ids) * keep.unsqueeze(-1).float()).sum(1))\n\n\n"
        "def build():\n"
        "    return Net()\n"
    )
    return operator_code


def save_half_fails(root: Path, **manifest_fields: object) -> Path:
    """:data:`HALF_FAILS`'s model with random weights, saved through the real store code as ``halffails`` (its folder
    must be on the code path: :func:`halfserve.models.add_code_path`)."""
    torch.manual_seed(0)
    fields: dict[str, object] = {
        "name": "halffails",
        "architecture": f"{HALF_FAILS}:build",
        "inputs": [
            TensorSpec(name="ids", datatype="INT64", shape=[6]),
            TensorSpec(name="keep", datatype="BOOL", shape=[6]),
        ],
        "outputs": [TensorSpec(name="output", shape=[3])],
        "precision": "bf16",
        **manifest_fields,
    }
    return store.save(root, Manifest.model_validate(fields), models.build(f"{HALF_FAILS}:build"))


@pytest.fixture
def tiny_store(tmp_path: Path) -> Path:
    save_tiny_mlp(tmp_path)
    return tmp_path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class ServerProcess:
    """A real ``halfserve serve`` on 127.0.0.1, started as a subprocess and killed by PID."""

    url: str
    proc: subprocess.Popen[bytes]
    log: Path

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_server(
    store_dir: Path, log: Path, *args: str, env: dict[str, str] | None = None, wrapper: list[str] | None = None
) -> ServerProcess:
    """``halfserve serve`` on a free port, once ready; ``wrapper``: a command that runs it (given as arguments)."""
    port = free_port()
    cmd = [sys.executable, "-m", "halfserve", "serve", "--store", str(store_dir), "--port", str(port), *args]
    cmd = [*(wrapper or []), *cmd]
    full_env = {**os.environ, **(env or {})}
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=full_env)
    server = ServerProcess(f"http://127.0.0.1:{port}", proc, log)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log.read_text()}")
        try:
            if httpx.get(f"{server.url}/ready", timeout=1).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    server.stop()
    raise RuntimeError(f"server not ready within 120 s:\n{log.read_text()}")


StartServer = Callable[..., ServerProcess]
"""The type of :func:`server_factory`."""


@pytest.fixture(scope="session")
def served_tiny_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One store with the tiny MLP for the servers of a whole session: a server only reads its store."""
    root = tmp_path_factory.mktemp("served-tiny-store")
    save_tiny_mlp(root)
    return root


@pytest.fixture(scope="module")
def server_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """Starts servers (:func:`start_server`) and stops them after the module's last test: kept for a whole session
    they added up (11 at once), each holding its models and threads while the rest of the suite ran."""
    started: list[ServerProcess] = []

    def factory(store_dir: Path, *args: str, env: dict[str, str] | None = None) -> ServerProcess:
        log = tmp_path_factory.mktemp("server") / "server.log"
        server = start_server(store_dir, log, *args, env=env)
        started.append(server)
        return server

    yield factory
    for s in started:
        s.stop()


@pytest.fixture
def segment() -> Iterator[shared_memory.SharedMemory]:
    """A 4 KiB POSIX shared memory object, as a client would create it (``/dev/shm/<name>``)."""
    shm = shared_memory.SharedMemory(name=f"halfserve-test-{secrets.token_hex(4)}", create=True, size=4096)
    try:
        yield shm
    finally:
        shm.close()
        shm.unlink()


def shm_key(shm: shared_memory.SharedMemory) -> str:
    """The object's POSIX name, as a client registers it."""
    return "/" + shm.name.lstrip("/")
