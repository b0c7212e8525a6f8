"""What Triton's ``image_client.py`` does, with ``tritonclient`` over HTTP and gRPC, against an image classifier put in
the store by ``halfserve import`` and served by a real ``halfserve serve``.

The client reads the model's metadata and configuration and refuses a model whose input has no image ``format``
(``FORMAT_NCHW`` or ``FORMAT_NHWC``); from the format and the dimensions it lays out the pixels it sends, a batch at a
time, and asks for the top classes (the classification extension), which come back as ``score:index:label``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import tritonclient.grpc as tg
import tritonclient.grpc.model_config_pb2 as mc
import tritonclient.http as th

from halfserve import models
from tests.conftest import ServerProcess, StartServer, free_port

pytestmark = pytest.mark.slow

MODEL = "pets"
LABELS = ["cat", "dog", "fish", "bird", "horse"]
CHANNELS, SIDE = 3, 16


def halfserve(*args: str) -> str:
    cmd = [sys.executable, "-m", "halfserve", *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, f"{' '.join(cmd)}\n{done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small CNN's state dict, imported with no format given: ``3x16x16`` is read as NCHW."""
    work = tmp_path_factory.mktemp("image-client")
    torch.manual_seed(0)
    kwargs = {"in_channels": CHANNELS, "num_classes": len(LABELS), "width": 8}
    torch.save(models.build("small_cnn", **kwargs).state_dict(), work / "weights.pth")
    (work / "labels.txt").write_text("\n".join(LABELS) + "\n")
    store = work / "store"
    halfserve(
        "import", str(work / "weights.pth"), "--store", str(store), "--name", MODEL, "--architecture", "small_cnn",
        "--arch-kwargs", json.dumps(kwargs), "--input", f"image:FP32:{CHANNELS}x{SIDE}x{SIDE}",
        "--labels", str(work / "labels.txt"), "--samples", "8",
    )  # fmt: skip
    manifest = json.loads((store / MODEL / "config.json").read_text())
    assert manifest["inputs"][0]["format"] == "FORMAT_NCHW"  # written as derived, so the operator sees it
    return store


@pytest.fixture(scope="module")
def server(server_factory: StartServer, store_dir: Path) -> tuple[ServerProcess, str]:
    port = free_port()
    process = server_factory(store_dir, "--precision", "fp32", "--grpc", "--grpc-port", str(port))
    return process, f"127.0.0.1:{port}"


@pytest.fixture
def http_client(server: tuple[ServerProcess, str]) -> Iterator[th.InferenceServerClient]:
    client = th.InferenceServerClient(server[0].url.removeprefix("http://"))
    yield client
    client.close()


@pytest.fixture
def grpc_client(server: tuple[ServerProcess, str]) -> Iterator[tg.InferenceServerClient]:
    client = tg.InferenceServerClient(server[1])
    yield client
    client.close()


def parse_model(
    inputs: list[Any], outputs: list[Any], config_inputs: list[Any], max_batch_size: int
) -> tuple[Any, ...]:
    """image_client.py's checks: one input and one FP32 vector output; an input of three dimensions after the batch's
    with format NCHW or NHWC (an integer, the enum's value: HTTP's string is looked up in the enum as the client does).
    Returns (input name, output name, c, h, w, format, input datatype)."""
    assert len(inputs) == len(outputs) == len(config_inputs) == 1
    (meta_in,), (meta_out,), (config_in,) = inputs, outputs, config_inputs
    assert meta_out["datatype"] == "FP32"
    assert sum(int(d) > 1 for d in meta_out["shape"][1:]) <= 1  # a vector, past the batch dimension
    shape = [int(d) for d in meta_in["shape"]]
    assert max_batch_size > 0
    assert len(shape) == 4
    layout = config_in["format"]
    if isinstance(layout, str):
        layout = dict(mc.ModelInput.Format.items())[layout]
    assert layout in (mc.ModelInput.FORMAT_NCHW, mc.ModelInput.FORMAT_NHWC), mc.ModelInput.Format.Name(layout)
    if layout == mc.ModelInput.FORMAT_NHWC:
        h, w, c = shape[1:]
    else:
        c, h, w = shape[1:]
    return meta_in["name"], meta_out["name"], c, h, w, layout, meta_in["datatype"]


def images(rows: int, c: int, h: int, w: int, layout: int) -> np.ndarray:
    """Pixels as the client sends them: HWC bytes, scaled to floats, transposed to CHW for NCHW."""
    hwc = np.random.default_rng(rows).integers(0, 256, (rows, h, w, c)).astype(np.float32) / 127.5 - 1
    return np.ascontiguousarray(hwc.transpose(0, 3, 1, 2)) if layout == mc.ModelInput.FORMAT_NCHW else hwc


def check_top_classes(top: np.ndarray, logits: np.ndarray, count: int) -> None:
    """Each row's ``score:index:label`` entries are its highest logits, best first, labelled."""
    assert top.shape == (len(logits), count)
    for row, want in zip(top, logits, strict=True):
        entries = [e.decode().split(":") for e in row]
        indices = [int(i) for _, i, _ in entries]
        assert indices == list(np.argsort(-want)[:count])
        assert [label for _, _, label in entries] == [LABELS[i] for i in indices]
        np.testing.assert_allclose([float(s) for s, _, _ in entries], want[indices], rtol=1e-4, atol=1e-5)


def test_http_as_image_client(http_client: th.InferenceServerClient) -> None:
    metadata = http_client.get_model_metadata(MODEL)
    config = http_client.get_model_config(MODEL)
    assert config["input"][0]["format"] == "FORMAT_NCHW"
    name, output, c, h, w, layout, datatype = parse_model(
        metadata["inputs"], metadata["outputs"], config["input"], config["max_batch_size"]
    )
    assert (c, h, w, datatype) == (CHANNELS, SIDE, SIDE, "FP32")
    x = images(2, c, h, w, layout)
    tensor = th.InferInput(name, list(x.shape), datatype)
    tensor.set_data_from_numpy(x, binary_data=True)
    logits = http_client.infer(MODEL, [tensor]).as_numpy(output)
    top = http_client.infer(MODEL, [tensor], outputs=[th.InferRequestedOutput(output, class_count=3)])
    check_top_classes(top.as_numpy(output), logits, 3)


def test_grpc_as_image_client(grpc_client: tg.InferenceServerClient) -> None:
    metadata = grpc_client.get_model_metadata(MODEL, as_json=True)
    config = grpc_client.get_model_config(MODEL).config
    assert config.input[0].format == mc.ModelInput.FORMAT_NCHW  # the protobuf enum, as the client compares it
    inputs = [{"name": config.input[0].name, "format": config.input[0].format}]
    name, output, c, h, w, layout, datatype = parse_model(
        metadata["inputs"], metadata["outputs"], inputs, config.max_batch_size
    )
    x = images(2, c, h, w, layout)
    tensor = tg.InferInput(name, list(x.shape), datatype)
    tensor.set_data_from_numpy(x)
    logits = grpc_client.infer(MODEL, [tensor]).as_numpy(output)
    top = grpc_client.infer(MODEL, [tensor], outputs=[tg.InferRequestedOutput(output, class_count=3)])
    check_top_classes(top.as_numpy(output), logits, 3)
