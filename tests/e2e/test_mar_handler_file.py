"""Archives whose handler is a file of their own, made by ``torch-model-archiver`` (``--handler top3_handler.py``):
``halfserve import --archive-code DIR`` copies the handler and the archive's other Python files into DIR, and served
with ``--code-path DIR`` a JPEG posted to ``/predictions`` is answered as the handler answers it, run here in fp32 on
the same pixels, within half precision's tolerance. An ``ImageClassifier`` subclass overriding ``postprocess`` (top 3,
through a helper module the archive ships), and a ``BaseHandler`` subclass with its own Pillow and numpy
``preprocess`` and an argmax ``postprocess``; both import TorchServe's ``ts``, which is not installed here."""

from __future__ import annotations

import hashlib
import io
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from halfserve.settings import Settings
from tests.e2e.test_mar_archiver import ARCHIVER
from tests.integration.conftest import serving
from tests.integration.test_mar_import import LABELS, MODEL_FILE, import_mar, photo, tiny_net, torchserve_pixels

TOP3_HANDLER = """
import torch.nn.functional as F
from ts.torch_handler.image_classifier import ImageClassifier

from answers import wrapped


class Top3Classifier(ImageClassifier):
    def initialize(self, context):
        super().initialize(context)
        self.set_max_result_classes(3)

    def postprocess(self, data):
        return [wrapped(row, self.context.model_name) for row in super().postprocess(data)]
"""
ANSWERS_HELPER = """
def wrapped(row, name):
    return {"model": name, "top3": row}
"""
ARGMAX_HANDLER = """
import io

import numpy as np
import torch
from PIL import Image
from ts.torch_handler.base_handler import BaseHandler


class ArgmaxHandler(BaseHandler):
    def preprocess(self, data):
        rows = []
        for row in data:
            image = Image.open(io.BytesIO(row.get("data") or row.get("body"))).convert("RGB").resize((64, 48))
            rows.append(np.asarray(image, dtype=np.float32).transpose(2, 0, 1) / 255)
        return torch.from_numpy(np.stack(rows))

    def postprocess(self, data):
        return [{"class": self.mapping[str(int(i))], "index": int(i)} for i in data.argmax(1)]
"""


def archived(folder: Path, handler: str, *extra: tuple[str, str]) -> Path:
    """``torch-model-archiver``'s archive of ``tiny_net``'s weights and model file, with ``handler`` as its handler
    file (named after the folder: modules of one name are one module in a process, as in any Python program) and
    ``index_to_name.json`` and ``extra`` (name, source) as its extra files."""
    folder.mkdir()
    (folder / "model.py").write_text(MODEL_FILE)
    torch.save(tiny_net().state_dict(), folder / "model.pt")
    (folder / "index_to_name.json").write_text(json.dumps(LABELS))
    (folder / f"{folder.name}_handler.py").write_text(handler)
    for name, source in extra:
        (folder / name).write_text(source)
    (folder / "out").mkdir()
    files = ",".join(["index_to_name.json", *(name for name, _ in extra)])
    args = "--model-name tinynet --version 1.0 --model-file model.py --serialized-file model.pt "
    args += f"--handler {folder.name}_handler.py --extra-files {files} --export-path out"
    run = subprocess.run(
        [sys.executable, "-c", ARCHIVER, *args.split()], cwd=folder, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr[-2000:]
    return folder / "out" / "tinynet.mar"


def imported(tmp_path: Path, mar: Path, *flags: str) -> tuple[Path, Path]:
    code, store = tmp_path / "code", tmp_path / "store"
    trust = ["--trust-model-file", "--code-path", str(code), "--archive-code", str(code)]
    assert import_mar(mar, store, *trust, *flags) == 0
    return code, store


async def test_an_image_classifier_subclass_answers_as_its_postprocess_says(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("model_archiver", reason="torch-model-archiver is in the test extra")
    mar = archived(tmp_path / "top3", TOP3_HANDLER, ("answers.py", ANSWERS_HELPER))
    code, store = imported(tmp_path, mar)
    assert f"halfserve serve --store {store} --code-path {code} (its handler is there)" in capsys.readouterr().out
    module = f"top3_handler_{hashlib.sha256(TOP3_HANDLER.encode()).hexdigest()[:8]}"  # one module per file's bytes
    assert (code / f"{module}.py").read_text() == TOP3_HANDLER
    assert (code / "answers.py").read_text() == ANSWERS_HELPER
    manifest = json.loads((store / "tinynet" / "config.json").read_text())
    assert manifest["handler"]["code"] == f"{module}:Top3Classifier"
    assert manifest["handler"]["style"] == "torchserve"
    jpeg = photo("JPEG")
    with torch.no_grad():  # the handler's logic in fp32: TorchServe's transforms, softmax, the top 3 by label
        probs = torch.softmax(tiny_net()(torch.from_numpy(torchserve_pixels(jpeg))[None]), 1)[0]
    values, indices = probs.topk(3)
    want = {LABELS[str(int(i))]: float(v) for v, i in zip(values, indices, strict=True)}
    async with serving(Settings(store=store, code_path=[code])) as client:
        r = await client.put("/predictions/tinynet", content=jpeg)  # type: ignore[attr-defined]  # curl -T
        assert r.status_code == 200, r.text
        got = r.json()
        assert got["model"] == "tinynet"
        assert list(got["top3"]) == list(want)
        for label, p in want.items():
            assert got["top3"][label] == pytest.approx(p, abs=0.02), label
        r = await client.post("/predictions/tinynet", files=[("data", jpeg), ("data", photo("PNG"))])
        assert r.status_code == 200, r.text
        assert [list(a["top3"]) for a in r.json()][0] == list(want)


async def test_a_base_handler_subclass_with_its_own_preprocess_answers_its_argmax(tmp_path: Path) -> None:
    pytest.importorskip("model_archiver", reason="torch-model-archiver is in the test extra")
    mar = archived(tmp_path / "argmax", ARGMAX_HANDLER)
    code, store = imported(tmp_path, mar, "--input", "input:FP32:3x48x64")
    assert (store / "tinynet" / "1" / "index_to_name.json").is_file()  # the handler's model_dir holds its files
    jpeg = photo("JPEG")
    pixels = np.asarray(Image.open(io.BytesIO(jpeg)).convert("RGB").resize((64, 48)), dtype=np.float32)
    with torch.no_grad():
        scores = tiny_net()(torch.from_numpy(pixels.transpose(2, 0, 1) / 255)[None])[0]
    best = int(scores.argmax())
    assert float(scores.topk(2).values.diff().abs()) > 0.05  # apart by more than half precision rounds
    async with serving(Settings(store=store, code_path=[code])) as client:
        r = await client.put("/predictions/tinynet", content=jpeg)  # type: ignore[attr-defined]
        assert r.status_code == 200, r.text
        assert r.json() == {"class": LABELS[str(best)], "index": best}


def test_a_handler_file_named_with_a_hyphen_is_imported(tmp_path: Path) -> None:
    """``torch-model-archiver --handler argmax-1_handler.py``, which TorchServe imports by its file: the copy's module
    name has an underscore for the hyphen."""
    pytest.importorskip("model_archiver", reason="torch-model-archiver is in the test extra")
    mar = archived(tmp_path / "argmax-1", ARGMAX_HANDLER)
    code, store = imported(tmp_path, mar, "--input", "input:FP32:3x48x64")
    module = f"argmax_1_handler_{hashlib.sha256(ARGMAX_HANDLER.encode()).hexdigest()[:8]}"
    assert (code / f"{module}.py").read_text() == ARGMAX_HANDLER
    assert json.loads((store / "tinynet" / "config.json").read_text())["handler"]["code"] == f"{module}:ArgmaxHandler"
