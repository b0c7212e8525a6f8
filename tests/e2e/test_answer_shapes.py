"""A team's own detection and segmentation models (their ``nn.Module`` on ``--code-path``) imported with ``--answer``,
served by a real server on 127.0.0.1: photos posted to ``/predictions`` (a raw body, and several in one form) answer
in the shapes of TorchServe's ``object_detector`` and ``image_segmenter``, matching a numpy reference of those
handlers' post-processing on the model's fp32 outputs; V2 still answers the tensors."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from PIL import Image

from halfserve import cli
from tests.conftest import StartServer

MODELS = """
import torch
from torch import nn


class TinyDetector(nn.Module):
    # At most five detections per image from its channel means; the fourth is padding (score 0), and the second
    # answers only for a red image.
    def __init__(self):
        super().__init__()
        self.box = nn.Linear(3, 20)
        self.score = nn.Linear(3, 5)

    def forward(self, x):
        f = x.mean((2, 3))
        boxes = 24 * torch.sigmoid(self.box(f)).view(-1, 5, 4)
        jitter = 0.02 * torch.tanh(self.score(f))
        red = (f[:, 0] > 0.5).to(jitter.dtype)
        base = torch.stack([0.9 + 0 * red, 0.2 + 0.6 * red, 0.75 + 0 * red, 0 * red, 0.6 + 0 * red], 1)
        scores = (base + jitter) * torch.tensor([1, 1, 1, 0, 1], dtype=jitter.dtype, device=x.device)
        labels = torch.tensor([2, 0, 1, 0, 2], device=x.device).expand(len(x), 5)
        return {"boxes": boxes, "scores": scores, "labels": labels}


class TinySegmenter(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x):
        return {"out": 4 * self.conv(x)}
"""
LABELS = ["person", "bicycle", "car"]
SIZE = (24, 32)  # height, width: photos are made at the input's size, so no resize changes their pixels


def build(code: Path, name: str, module: str = "answer_models") -> torch.nn.Module:
    scope: dict[str, Any] = {}
    exec((code / f"{module}.py").read_text(), scope)  # the test's own code, as the server imports it
    torch.manual_seed(0)
    net: torch.nn.Module = scope[name]().eval()
    return net


def photo(rgb: tuple[int, int, int], seed: int, fmt: str = "PNG") -> bytes:
    rng = np.random.default_rng(seed)
    pixels = np.clip(np.array(rgb) + rng.normal(0, 20, (*SIZE, 3)), 0, 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, fmt, **({"quality": 95} if fmt == "JPEG" else {}))
    return out.getvalue()


def fp32_outputs(net: torch.nn.Module, data: bytes) -> dict[str, np.ndarray]:
    """The model's fp32 outputs on a photo as TorchServe's ToTensor gives it (RGB scaled to 0..1, channels first)."""
    x = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"), dtype=np.float32).transpose(2, 0, 1) / 255
    with torch.no_grad():
        return {k: v[0].float().numpy() for k, v in net(torch.from_numpy(x)[None]).items()}


def reference_detections(out: dict[str, np.ndarray], threshold: float = 0.5) -> list[tuple[str, np.ndarray, float]]:
    """TorchServe's object_detector postprocess: scores at or above the threshold, the class named by its label."""
    keep = out["scores"] >= threshold
    return [
        (LABELS[int(c)], b, float(s))
        for b, s, c in zip(out["boxes"][keep], out["scores"][keep], out["labels"][keep], strict=True)
    ]


def reference_segmentation(out: np.ndarray) -> np.ndarray:
    """TorchServe's image_segmenter postprocess: softmax over the classes, then each pixel's [class, probability]."""
    exp = np.exp(out - out.max(0))
    probabilities = exp / exp.sum(0)
    return np.stack([probabilities.argmax(0).astype(np.float64), probabilities.max(0)], -1)


def import_model(
    store: Path, code: Path, name: str, cls: str, answer: str, *extra: str, module: str = "answer_models"
) -> None:
    """Import ``module:cls`` from ``code`` (a module name the process has not imported from elsewhere)."""
    weights = store.parent / f"{name}.pt"
    torch.save(build(code, cls, module).state_dict(), weights)
    args = ["import", str(weights), "--store", str(store), "--name", name, "--architecture", f"{module}:{cls}"]
    args += [
        "--input",
        f"input:FP32:3x{SIZE[0]}x{SIZE[1]}",
        "--image",
        "image",
        "--image-resize",
        "x".join(map(str, SIZE)),
    ]
    assert cli.main([*args, "--answer", answer, "--code-path", str(code), "--device", "cpu", *extra]) == 0


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, server_factory: StartServer) -> tuple[str, Path]:
    root = tmp_path_factory.mktemp("answers")
    code, store = root / "code", root / "store"
    code.mkdir()
    (code / "answer_models.py").write_text(MODELS)
    (root / "labels.txt").write_text("\n".join(LABELS))
    # Eight detections declared, five returned: the server pads the rest with score 0, which never answers.
    outputs = ["--output", "boxes:FP32:8x4", "--output", "scores:FP32:8", "--output", "labels:INT64:8"]
    import_model(store, code, "detector", "TinyDetector", "detections", "--labels", str(root / "labels.txt"), *outputs)
    import_model(store, code, "segmenter", "TinySegmenter", "segmentation")
    server = server_factory(store, "--code-path", str(code))
    return server.url, code


def check_detections(answer: list[dict[str, Any]], out: dict[str, np.ndarray]) -> None:
    expected = reference_detections(out)
    assert len(answer) == len(expected)
    for got, (label, box, score) in zip(answer, expected, strict=True):
        assert list(got) == [label, "score"]
        np.testing.assert_allclose(got[label], box, atol=0.25)  # half precision's rounding of boxes up to 24 pixels
        assert got["score"] == pytest.approx(score, abs=0.02)


def test_a_detector_answers_as_torchserve_s_object_detector(served: tuple[str, Path]) -> None:
    url, code = served
    net = build(code, "TinyDetector")
    red, grey = photo((220, 40, 40), 1), photo((90, 90, 90), 2, "JPEG")
    r = httpx.put(f"{url}/predictions/detector", content=red, timeout=30)  # curl -T
    assert r.status_code == 200, r.text
    check_detections(r.json(), fp32_outputs(net, red))
    assert [next(iter(d)) for d in r.json()] == ["car", "person", "bicycle", "car"]  # the padding is not answered
    files = [("data", ("a.png", red, "image/png")), ("data", ("b.jpg", grey, "image/jpeg"))]
    r = httpx.post(f"{url}/predictions/detector", files=files, timeout=30)
    assert r.status_code == 200, r.text
    first, second = r.json()
    check_detections(first, fp32_outputs(net, red))
    check_detections(second, fp32_outputs(net, grey))
    assert [next(iter(d)) for d in second] == ["car", "bicycle", "car"]  # grey: the second detection scores 0.2


def test_a_segmenter_answers_as_torchserve_s_image_segmenter(served: tuple[str, Path]) -> None:
    url, code = served
    net = build(code, "TinySegmenter")
    photos = [photo((40, 160, 90), 3), photo((200, 200, 30), 4, "JPEG")]
    r = httpx.post(f"{url}/predictions/segmenter", files=[("data", p) for p in photos], timeout=30)
    assert r.status_code == 200, r.text
    for answer, data in zip(r.json(), photos, strict=True):
        got, expected = np.array(answer), reference_segmentation(fp32_outputs(net, data)["out"])
        assert got.shape == (*SIZE, 2)
        same = got[..., 0] == expected[..., 0]
        assert same.mean() > 0.95  # a pixel whose two best classes are within rounding may flip
        np.testing.assert_allclose(got[..., 1][same], expected[..., 1][same], atol=0.03)
    one = httpx.put(f"{url}/predictions/segmenter", content=photos[0], timeout=30).json()
    assert np.array(one).shape == (*SIZE, 2)  # one file: its answer alone, not a list of one


def test_v2_and_predict_still_answer_the_tensors(served: tuple[str, Path]) -> None:
    url, _ = served
    x = np.full((1, 3, *SIZE), 0.8, np.float32)
    body = {"inputs": [{"name": "input", "datatype": "FP32", "shape": list(x.shape), "data": x.ravel().tolist()}]}
    r = httpx.post(f"{url}/v2/models/detector/infer", json=body, timeout=30)
    assert r.status_code == 200, r.text
    shapes = {o["name"]: o["shape"] for o in r.json()["outputs"]}
    assert shapes == {"boxes": [1, 8, 4], "scores": [1, 8], "labels": [1, 8]}
    r = httpx.post(f"{url}/predict", json={"model": "detector", "inputs": x.tolist()}, timeout=30)
    assert r.status_code == 200, r.text
    assert set(r.json()["outputs"]) == {"boxes", "scores", "labels"}
    assert "labels" not in r.json()  # the labels name the detections' classes, not the boxes' columns
