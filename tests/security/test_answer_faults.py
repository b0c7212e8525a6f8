"""A detector whose outputs do not hold what its manifest's ``answer`` declares (a class past its labels, more
detections than declared, a box of five numbers) answers that request with a one-line 500 in TorchServe's error shape,
and the server serves on: the same model answers the next photo."""

from __future__ import annotations

import httpx
import pytest

from tests.conftest import ServerProcess, StartServer
from tests.e2e.test_answer_shapes import LABELS, MODELS, import_model, photo

FAULTY = """

class _Faulty(nn.Module):
    # A detector that goes wrong only for a red photo: random calibration rows (channel means near 0.5, or 0) never
    # reach it, so the import measures a well-behaved model.
    def __init__(self):
        super().__init__()
        self.box = nn.Linear(3, 32)

    def forward(self, x):
        f = x.mean((2, 3))
        red = bool(((f[:, 0] > 0.75) & (f[:, 1] < 0.35)).any())
        boxes = torch.sigmoid(self.box(f)).view(-1, 8, 4)
        scores = torch.ones(len(x), 8, dtype=boxes.dtype, device=x.device)
        labels = torch.ones(len(x), 8, dtype=torch.int64, device=x.device)
        return self.fault(red, boxes, scores, labels)


class PastTheLabels(_Faulty):
    def fault(self, red, boxes, scores, labels):
        return {"boxes": boxes, "scores": scores, "labels": labels * 7 if red else labels}


class TooMany(_Faulty):
    def fault(self, red, boxes, scores, labels):
        if red:
            boxes, scores, labels = (torch.cat([t, t[:, :1]], 1) for t in (boxes, scores, labels))
        return {"boxes": boxes, "scores": scores, "labels": labels}


class FiveNumbers(_Faulty):
    def fault(self, red, boxes, scores, labels):
        if red:
            boxes = torch.cat([boxes, boxes[..., :1]], -1)
        return {"boxes": boxes, "scores": scores, "labels": labels}
"""
FAULTS = {
    "pastthelabels": ("PastTheLabels", "output labels: class 7 is past the model's 3 labels"),
    "toomany": ("TooMany", "output 'boxes' has rows of shape [9, 4], not [8, 4]"),
    "fivenumbers": ("FiveNumbers", "output 'boxes' has rows of shape [8, 5], not [8, 4]"),
}
"""Model name: (its class above, what its 500's message must hold)."""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, server_factory: StartServer) -> ServerProcess:
    root = tmp_path_factory.mktemp("faulty-answers")
    code, store = root / "code", root / "store"
    code.mkdir()
    (code / "faulty_answers.py").write_text(MODELS + FAULTY)
    (root / "labels.txt").write_text("\n".join(LABELS))
    outputs = ["--output", "boxes:FP32:8x4", "--output", "scores:FP32:8", "--output", "labels:INT64:8"]
    for name, (cls, _) in FAULTS.items():
        labels = ["--labels", str(root / "labels.txt")]
        import_model(store, code, name, cls, "detections", *labels, *outputs, module="faulty_answers")
    return server_factory(store, "--code-path", str(code))


@pytest.mark.parametrize("name", list(FAULTS))
def test_outputs_unlike_the_declaration_are_that_request_s_500_and_the_server_serves_on(
    server: ServerProcess, name: str
) -> None:
    r = httpx.put(f"{server.url}/predictions/{name}", content=photo((230, 20, 20), 5), timeout=30)
    assert r.status_code == 500, r.text
    body = r.json()
    assert (body["code"], body["type"]) == (500, "InternalServerException")
    assert FAULTS[name][1] in body["message"]
    assert "\n" not in body["message"]
    assert "Traceback" not in body["message"]
    assert len(body["message"]) < 500
    good = httpx.put(f"{server.url}/predictions/{name}", content=photo((60, 60, 200), 6), timeout=30)
    assert good.status_code == 200, good.text
    assert len(good.json()) == 8  # every detection scores 1
