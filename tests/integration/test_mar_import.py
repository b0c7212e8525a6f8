"""TorchServe archives (``.mar``) into the store: ``halfserve import model.mar`` reads the archive torch-model-archiver
writes (a state dict, a model file, the stock ``image_classifier``, ``object_detector`` and ``image_segmenter``
handlers, ``index_to_name.json``), and a photo posted to ``/predictions`` is answered as TorchServe's handler would
answer it; what cannot be imported safely is refused with the reason."""

from __future__ import annotations

import io
import json
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from halfserve import cli
from halfserve.settings import Settings
from tests.integration.conftest import serving

MODEL_FILE = """
import torch
from torch import nn


class TinyNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 5, stride=4)
        self.fc = nn.Linear(8, 10)

    def forward(self, x):
        return self.fc(torch.relu(self.conv(x)).mean((2, 3)))
"""
LABELS = {str(i): f"class_{i}" for i in range(10)}
MEAN, STD = np.array([0.485, 0.456, 0.406]), np.array([0.229, 0.224, 0.225])


def tiny_net() -> torch.nn.Module:
    scope: dict[str, object] = {}
    exec(MODEL_FILE, scope)  # the test's own code, as the archive's model file holds it
    torch.manual_seed(0)
    net: torch.nn.Module = scope["TinyNet"]()  # type: ignore[operator]
    with torch.no_grad():  # classes well apart, so the top 5's order is the model's, not rounding's
        net.fc.bias.copy_(torch.arange(10, dtype=torch.float32) * 0.7)  # type: ignore[union-attr, operator]
    return net


def archive(
    path: Path,
    net: torch.nn.Module,
    *,
    handler: str = "image_classifier",
    model_name: str = "tinynet",
    labels: bool = True,
    **extra: bytes,
) -> Path:
    """A .mar laid out as torch-model-archiver lays it out (MAR-INF/MANIFEST.json beside the files by base name)."""
    weights = io.BytesIO()
    torch.save(net.state_dict(), weights)
    manifest = {
        "createdOn": "28/11/2026 08:00:00",
        "runtime": "python",
        "model": {
            "modelName": model_name,
            "serializedFile": "model.pt",
            "handler": handler,
            "modelFile": "model.py",
            "modelVersion": "1.0",
        },
        "archiverVersion": "0.12.0",
    }
    files = {"MAR-INF/MANIFEST.json": json.dumps(manifest).encode(), "model.py": MODEL_FILE.encode()}
    files |= {"model.pt": weights.getvalue(), **extra}
    if labels:
        files["index_to_name.json"] = json.dumps(LABELS).encode()
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in files.items():
            z.writestr(name, data)
    return path


def photo(fmt: str) -> bytes:
    rng = np.random.default_rng(3)
    pixels = (rng.random((300, 400, 3)) * 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, fmt, **({"quality": 95} if fmt == "JPEG" else {}))
    return out.getvalue()


def torchserve_pixels(data: bytes) -> np.ndarray:
    """TorchServe's image_classifier and image_segmenter transforms in Pillow and numpy: Resize(256),
    CenterCrop(224), ToTensor, Normalize; ``[3, 224, 224]`` float32."""
    image = Image.open(io.BytesIO(data)).convert("RGB")
    w, h = image.size
    size = (int(256 * w / h), 256) if w >= h else (256, int(256 * h / w))
    image = image.resize(size, Image.Resampling.BILINEAR)
    left, top = int(round((size[0] - 224) / 2.0)), int(round((size[1] - 224) / 2.0))
    image = image.crop((left, top, left + 224, top + 224))
    x: np.ndarray = ((np.asarray(image, dtype=np.float32) / 255 - MEAN) / STD).astype(np.float32)
    return x.transpose(2, 0, 1)


def reference_top5(net: torch.nn.Module, data: bytes, labels: dict[str, str] | None = LABELS) -> dict[str, float]:
    """TorchServe's image_classifier in Pillow and numpy: its transforms, then softmax top 5, in fp32; each class by
    its index where the archive has no labels (``map_class_to_label`` without a mapping)."""
    with torch.no_grad():
        probs = torch.softmax(net(torch.from_numpy(torchserve_pixels(data))[None]), 1)[0]
    values, indices = probs.topk(5)
    named = (lambda i: labels[i]) if labels is not None else (lambda i: i)
    return {named(str(int(i))): float(v) for v, i in zip(values, indices, strict=True)}


def import_mar(mar: Path, store: Path, *extra: str) -> int:
    return cli.main(["import", str(mar), "--store", str(store), "--device", "cpu", *extra])


async def test_an_image_classifier_archive_answers_photos_as_torchserve_s_handler(tmp_path: Path) -> None:
    net = tiny_net()
    code = tmp_path / "code"
    mar = archive(tmp_path / "tinynet.mar", net)
    assert import_mar(mar, tmp_path / "store", "--trust-model-file", "--code-path", str(code)) == 0
    assert (code / "mar_tinynet.py").read_text() == MODEL_FILE
    await answers_as_torchserve(tmp_path / "store", code, net)


async def test_an_image_classifier_archive_without_labels_names_classes_by_index_as_torchserve_does(
    tmp_path: Path,
) -> None:
    """Without index_to_name.json TorchServe's image_classifier answers the top 5 keyed by class index
    (``{"9": 0.62, ...}``); the raw logits had come back."""
    net = tiny_net()
    code = tmp_path / "code"
    mar = archive(tmp_path / "tinynet.mar", net, labels=False)
    assert import_mar(mar, tmp_path / "store", "--trust-model-file", "--code-path", str(code)) == 0
    await answers_as_torchserve(tmp_path / "store", code, net, None)


async def answers_as_torchserve(
    store: Path, code: Path, net: torch.nn.Module, labels: dict[str, str] | None = LABELS
) -> None:
    """A JPEG and a PNG posted to ``/predictions/tinynet`` get the reference's top 5, highest first, with
    probabilities within half precision's tolerance."""
    async with serving(Settings(store=store, code_path=[code])) as client:
        for fmt in ("JPEG", "PNG"):
            data = photo(fmt)
            r = await client.put("/predictions/tinynet", content=data)  # type: ignore[attr-defined]  # curl -T
            assert r.status_code == 200, r.text
            got, want = r.json(), reference_top5(net, data, labels)
            assert list(got) == list(want), (fmt, got, want)  # the same labels, highest first
            for label, p in want.items():
                assert got[label] == pytest.approx(p, abs=0.02), (fmt, label)


def test_a_model_file_is_not_run_without_the_operator_s_word(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    mar = archive(tmp_path / "tinynet.mar", tiny_net())
    assert import_mar(mar, tmp_path / "store") == 2
    err = capsys.readouterr().err
    assert "model file model.py is Python code" in err
    assert "--trust-model-file --code-path DIR" in err
    assert not (tmp_path / "store" / "tinynet").exists()
    assert import_mar(mar, tmp_path / "store", "--trust-model-file") == 2  # and only into a folder the operator names
    assert "give --code-path DIR too" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("change", "named"),
    [
        pytest.param({"handler": "text_classifier"}, "handler 'text_classifier' is not imported", id="text"),
        pytest.param(
            {"handler": "my_handler.py", "my_handler.py": b"class Mine:\n    pass\n"},
            "then import with --archive-code DIR",
            id="custom",
        ),
        pytest.param({"handler": "gone.py"}, "neither a stock handler nor a file it holds", id="no-handler-file"),
        pytest.param(
            {"handler": "sub/h.py", "sub/h.py": b"class H:\n    pass\n"},
            "a handler file is found by its base name at the archive's top level, where it holds no h.py",
            id="handler-in-a-folder",
        ),
        pytest.param({"handler": "my_handler:handle"}, "is a function entry point", id="function"),
        pytest.param({"../evil.py": b"x"}, "is not a plain relative path", id="dot-dot"),
        pytest.param({"/etc/evil": b"x"}, "is not a plain relative path", id="absolute"),
    ],
)
def test_what_cannot_be_imported_safely_is_refused_with_the_reason(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], change: dict[str, object], named: str
) -> None:
    handler = str(change.pop("handler", "image_classifier"))
    mar = archive(tmp_path / "x.mar", tiny_net(), handler=handler, **change)  # type: ignore[arg-type]
    code = tmp_path / "code"
    assert import_mar(mar, tmp_path / "store", "--trust-model-file", "--code-path", str(code)) == 2
    assert named in capsys.readouterr().err
    assert not (tmp_path / "evil.py").exists()
    assert not (tmp_path / "store" / "tinynet").exists()


def test_a_torchscript_or_pickled_model_is_refused_with_the_fix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    net = tiny_net()
    scripted = io.BytesIO()  # laid out as torch.jit.save lays a module out (its code and its constants)
    with zipfile.ZipFile(scripted, "w") as z:
        z.writestr("scripted/code/__torch__.py", b"def forward(self, x): ...")
        z.writestr("scripted/constants.pkl", b"")
        z.writestr("scripted/data.pkl", b"")
    mar = archive(tmp_path / "ts.mar", net)
    with zipfile.ZipFile(mar, "a") as z:
        z.writestr("scripted.pt", scripted.getvalue())
    manifest = json.loads(zipfile.ZipFile(mar).read("MAR-INF/MANIFEST.json"))
    manifest["model"]["serializedFile"] = "scripted.pt"
    rebuilt = tmp_path / "ts2.mar"
    with zipfile.ZipFile(mar) as src, zipfile.ZipFile(rebuilt, "w") as dst:
        for item in src.infolist():
            data = json.dumps(manifest).encode() if item.filename == "MAR-INF/MANIFEST.json" else src.read(item)
            dst.writestr(item.filename, data)
    code = tmp_path / "code"
    assert import_mar(rebuilt, tmp_path / "store", "--trust-model-file", "--code-path", str(code)) == 2
    assert "is a TorchScript module" in capsys.readouterr().err


def test_a_zip_bomb_and_too_many_files_are_refused_before_they_are_unpacked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bomb = tmp_path / "bomb.mar"
    with zipfile.ZipFile(bomb, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("MAR-INF/MANIFEST.json", b"{}")
        z.writestr("zeros.bin", b"\0" * (64 * 1024**2))  # 64 MiB of zeros: about 64 KB compressed
    assert import_mar(bomb, tmp_path / "store", "--name", "b") == 2
    assert "a zip bomb?" in capsys.readouterr().err
    many = tmp_path / "many.mar"
    with zipfile.ZipFile(many, "w") as z:
        for i in range(1_001):
            z.writestr(f"f{i}", b"")
    assert import_mar(many, tmp_path / "store", "--name", "m") == 2
    assert "1001 files, more than the 1000" in capsys.readouterr().err
    twice = archive(tmp_path / "twice.mar", tiny_net())
    with pytest.warns(UserWarning, match="Duplicate name"), zipfile.ZipFile(twice, "a") as z:
        z.writestr("model.pt", b"other weights")  # which one would be the model's?
    assert import_mar(twice, tmp_path / "store", "--trust-model-file", "--code-path", str(tmp_path / "code")) == 2
    assert "member 'model.pt' appears twice" in capsys.readouterr().err


def test_an_archive_name_that_is_no_store_name_is_refused_before_anything_is_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    mar = archive(tmp_path / "x.mar", tiny_net(), model_name="../evil")
    code = tmp_path / "code"
    assert import_mar(mar, tmp_path / "store", "--trust-model-file", "--code-path", str(code)) == 2
    assert "the archive's modelName is not a store name; give --name" in capsys.readouterr().err
    assert not code.exists()
    assert import_mar(mar, tmp_path / "store", "--trust-model-file", "--code-path", str(code), "--name", ".cache") == 2
    err = capsys.readouterr().err
    assert err.rstrip().endswith(": --name"), err  # the name given is what is wrong, not the archive's
    assert not code.exists()


DETECTOR_FILE = """
import torch
from torch import nn


class Detector(nn.Module):
    def __init__(self):
        super().__init__()
        self.box = nn.Linear(3, 8)

    def forward(self, x):
        f = x.mean((2, 3))
        scores = torch.tensor([0.9, 0.1], dtype=f.dtype, device=x.device).expand(len(x), 2)
        labels = torch.tensor([3, 1], device=x.device).expand(len(x), 2)
        return {"boxes": 32 * torch.sigmoid(self.box(f)).view(-1, 2, 4), "scores": scores, "labels": labels}
"""
SEGMENTER_FILE = """
from torch import nn


class Segmenter(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 10, 1)

    def forward(self, x):
        return {"out": self.conv(x)}
"""


def stock_archive(path: Path, handler: str, source: str) -> Path:
    """An archive of ``handler`` whose model file is ``source`` (one nn.Module), with its weights."""
    scope: dict[str, object] = {}
    exec(source, scope)  # the test's own code, as the archive's model file holds it
    net = next(v for k, v in scope.items() if k in ("Detector", "Segmenter"))()  # type: ignore[operator]
    return archive(path, net, handler=handler, model_name=handler.replace("_", ""), **{"model.py": source.encode()})


async def test_the_detector_and_segmenter_stock_handlers_become_their_answers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, store = tmp_path / "code", tmp_path / "store"
    detector = stock_archive(tmp_path / "det.mar", "object_detector", DETECTOR_FILE)
    trust = ["--trust-model-file", "--code-path", str(code)]
    assert import_mar(detector, store, *trust) == 2  # its images come in any size; a batch holds one
    assert "object_detector takes images of any size" in capsys.readouterr().err
    assert not code.exists()  # refused before the model file was copied
    # The photos' own name, image, for the tensor too: had been refused with no word of which flag to change.
    assert import_mar(detector, store, *trust, "--input", "image:FP32:3x32x40") == 2
    assert "the tensor input needs another name (--input input:FP32:...)" in capsys.readouterr().err
    assert not code.exists()
    assert import_mar(detector, store, *trust, "--input", "image:FP32:3x32x40", "--image", "image") == 2
    assert "--image image: 'image' is also the tensor input's name (--input)" in capsys.readouterr().err
    assert import_mar(detector, store, *trust, "--input", "input:FP32:3x32x40") == 0
    segmenter = stock_archive(tmp_path / "seg.mar", "image_segmenter", SEGMENTER_FILE)
    assert import_mar(segmenter, store, *trust) == 0
    det = json.loads((store / "objectdetector" / "config.json").read_text())
    assert det["image"]["resize"] == [32, 40]
    assert "mean" not in det["image"]
    assert det["answer"] == {"detections": {"boxes": "boxes", "scores": "scores", "labels": "labels", "threshold": 0.5}}
    seg = json.loads((store / "imagesegmenter" / "config.json").read_text())
    assert (seg["image"]["resize"], seg["image"]["crop"], seg["answer"]) == (
        256,
        224,
        {"segmentation": {"output": "out"}},
    )
    async with serving(Settings(store=store, code_path=[code])) as client:
        r = await client.put("/predictions/objectdetector", content=photo("JPEG"))  # type: ignore[attr-defined]
        assert r.status_code == 200, r.text
        [found] = r.json()  # the second detection scores 0.1, under TorchServe's 0.5
        assert list(found) == ["class_3", "score"]
        assert len(found["class_3"]) == 4
        r = await client.put("/predictions/imagesegmenter", content=photo("PNG"))  # type: ignore[attr-defined]
        assert r.status_code == 200, r.text
        assert np.array(r.json()).shape == (224, 224, 2)
