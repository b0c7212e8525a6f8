"""An archive made by TorchServe's own ``torch-model-archiver`` (pinned in the test extra), from a small state-dict
CNN with ``--model-file``, ``--serialized-file``, ``--handler image_classifier`` and ``--extra-files
index_to_name.json``: ``halfserve import`` takes it, and a JPEG and a PNG posted to ``/predictions`` get the top-5
labels TorchServe's transforms and softmax give in fp32, with probabilities within half precision's tolerance. And
archives of its ``object_detector`` and ``image_segmenter`` handlers answer as those handlers post-process the model's
fp32 outputs."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from halfserve.settings import Settings
from tests.e2e.test_answer_shapes import reference_segmentation
from tests.integration.conftest import serving
from tests.integration.test_mar_import import (
    DETECTOR_FILE,
    LABELS,
    MODEL_FILE,
    SEGMENTER_FILE,
    answers_as_torchserve,
    import_mar,
    photo,
    tiny_net,
    torchserve_pixels,
)

ARCHIVER = "from model_archiver.model_packaging import generate_model_archive; generate_model_archive()"


def archived(
    folder: Path, handler: str = "image_classifier", source: str = MODEL_FILE, name: str = "tinynet"
) -> tuple[Path, torch.nn.Module]:
    """``torch-model-archiver``'s archive of ``source``'s one module (``tiny_net`` for the classifier) and its
    weights, with ``handler`` and ``index_to_name.json``."""
    if source == MODEL_FILE:
        net = tiny_net()
    else:
        scope: dict[str, Any] = {}
        exec(source, scope)  # the test's own code, as the archive's model file holds it
        torch.manual_seed(0)
        net = next(v for k, v in scope.items() if k in ("Detector", "Segmenter"))().eval()
    (folder / "model.py").write_text(source)
    torch.save(net.state_dict(), folder / "model.pt")
    (folder / "index_to_name.json").write_text(json.dumps(LABELS))
    (folder / "out").mkdir()
    args = f"--model-name {name} --version 1.0 --model-file model.py --serialized-file model.pt "
    args += f"--handler {handler} --extra-files index_to_name.json --export-path out"
    run = subprocess.run(
        [sys.executable, "-c", ARCHIVER, *args.split()], cwd=folder, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr[-2000:]
    return folder / "out" / f"{name}.mar", net


async def test_an_archive_torch_model_archiver_made_answers_as_torchserve_s_handler(tmp_path: Path) -> None:
    pytest.importorskip("model_archiver", reason="torch-model-archiver is in the test extra")
    mar, net = archived(tmp_path)
    code = tmp_path / "code"
    assert import_mar(mar, tmp_path / "store", "--trust-model-file", "--code-path", str(code)) == 0
    await answers_as_torchserve(tmp_path / "store", code, net)


async def test_detector_and_segmenter_archives_answer_as_torchserve_s_handlers(tmp_path: Path) -> None:
    """Each photo's answer against TorchServe's post-processing of the model's fp32 outputs on the same pixels: the
    detector's (``ToTensor`` at the input's size) boxes and scores past the threshold, named by
    ``index_to_name.json``; the segmenter's (the classifier's transforms) class and probability per pixel."""
    pytest.importorskip("model_archiver", reason="torch-model-archiver is in the test extra")
    code, store = tmp_path / "code", tmp_path / "store"
    (tmp_path / "det").mkdir()
    (tmp_path / "seg").mkdir()
    det_mar, detector = archived(tmp_path / "det", "object_detector", DETECTOR_FILE, "detector")
    seg_mar, segmenter = archived(tmp_path / "seg", "image_segmenter", SEGMENTER_FILE, "segmenter")
    trust = ["--trust-model-file", "--code-path", str(code)]
    assert import_mar(det_mar, store, *trust, "--input", "input:FP32:3x32x40") == 0
    assert import_mar(seg_mar, store, *trust) == 0
    jpeg = photo("JPEG")
    pixels = np.asarray(Image.open(io.BytesIO(jpeg)).convert("RGB").resize((40, 32), Image.Resampling.BILINEAR))
    with torch.no_grad():
        found = detector(torch.from_numpy(pixels.transpose(2, 0, 1) / np.float32(255))[None])
        scores = segmenter(torch.from_numpy(torchserve_pixels(jpeg))[None])["out"][0].numpy()
    keep = found["scores"][0] >= 0.5
    expected = [
        (LABELS[str(int(c))], b.numpy(), float(s))
        for b, s, c in zip(found["boxes"][0][keep], found["scores"][0][keep], found["labels"][0][keep], strict=True)
    ]
    async with serving(Settings(store=store, code_path=[code])) as client:
        r = await client.put("/predictions/detector", content=jpeg)  # type: ignore[attr-defined]
        assert r.status_code == 200, r.text
        assert [next(iter(d)) for d in r.json()] == [label for label, _, _ in expected] == ["class_3"]
        for got, (label, box, score) in zip(r.json(), expected, strict=True):
            np.testing.assert_allclose(got[label], box, atol=0.25)
            assert got["score"] == pytest.approx(score, abs=0.01)
        r = await client.put("/predictions/segmenter", content=jpeg)  # type: ignore[attr-defined]
        assert r.status_code == 200, r.text
    got, want = np.array(r.json()), reference_segmentation(scores)
    same = got[..., 0] == want[..., 0]
    assert same.mean() > 0.95  # a pixel whose two best classes are within rounding may flip
    np.testing.assert_allclose(got[..., 1][same], want[..., 1][same], atol=0.03)
