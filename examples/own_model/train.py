"""Train :class:`digits_net.DigitsNet` on scikit-learn's bundled digits for a few seconds, the way a team trains its
own model, and save what teams usually have: a ``.pth`` state dict (here wrapped as ``{"state_dict": ...}`` with
DataParallel's ``module.`` prefixes, which ``halfserve import`` unwraps), plus 200 held-out digits as calibration
samples (``.npy``).

    python examples/own_model/train.py OUT_DIR
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
from sklearn.datasets import load_digits

sys.path.insert(0, str(Path(__file__).parent))
from digits_net import build  # noqa: E402


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32)
    y = torch.tensor(digits.target)
    torch.manual_seed(0)
    model = build()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    train, held_out = slice(0, 1500), slice(1500, 1700)
    for _ in range(60):
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x[train]), y[train])
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        accuracy = (model(x[held_out]).argmax(1) == y[held_out]).float().mean().item()
    wrapped = {"state_dict": {f"module.{k}": v for k, v in model.state_dict().items()}, "epoch": 60}
    torch.save(wrapped, out / "weights.pth")
    np.save(out / "calibration.npy", digits.data[held_out].astype(np.float32))
    (out / "labels.txt").write_text("\n".join(str(d) for d in range(10)) + "\n")
    print(f"held-out accuracy {accuracy:.3f}; wrote {out / 'weights.pth'}, calibration.npy and labels.txt")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "own_model_out"))
