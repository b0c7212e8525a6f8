"""An archive made by TorchServe's own ``torch-model-archiver`` (pinned in the test extra), from a small state-dict
CNN with ``--model-file``, ``--serialized-file``, ``--handler image_classifier`` and ``--extra-files
index_to_name.json``: ``halfserve import`` takes it, and a JPEG and a PNG posted to ``/predictions`` get the top-5
labels TorchServe's transforms and softmax give in fp32, with probabilities within half precision's tolerance."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.integration.test_mar_import import LABELS, MODEL_FILE, answers_as_torchserve, import_mar, tiny_net

ARCHIVER = "from model_archiver.model_packaging import generate_model_archive; generate_model_archive()"


def archived(folder: Path) -> tuple[Path, torch.nn.Module]:
    net = tiny_net()
    (folder / "model.py").write_text(MODEL_FILE)
    torch.save(net.state_dict(), folder / "model.pt")
    (folder / "index_to_name.json").write_text(json.dumps(LABELS))
    (folder / "out").mkdir()
    args = "--model-name tinynet --version 1.0 --model-file model.py --serialized-file model.pt "
    args += "--handler image_classifier --extra-files index_to_name.json --export-path out"
    run = subprocess.run(
        [sys.executable, "-c", ARCHIVER, *args.split()], cwd=folder, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr[-2000:]
    return folder / "out" / "tinynet.mar", net


async def test_an_archive_torch_model_archiver_made_answers_as_torchserve_s_handler(tmp_path: Path) -> None:
    pytest.importorskip("model_archiver", reason="torch-model-archiver is in the test extra")
    mar, net = archived(tmp_path)
    code = tmp_path / "code"
    assert import_mar(mar, tmp_path / "store", "--trust-model-file", "--code-path", str(code)) == 0
    await answers_as_torchserve(tmp_path / "store", code, net)
