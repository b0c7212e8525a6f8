"""A torchvision ResNet-18 as a team would have it after fine-tuning on 10 classes: a ``.pth`` state dict. (Random
weights here: nothing is downloaded.) Needs torchvision built for the installed torch (``pip install
'halfserve[vision]'``; beside a CPU-only torch, the command the script prints when it is missing or does not import).

    python examples/torchvision_resnet18/save_state_dict.py OUT_DIR
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from halfserve import models


def main(out: Path) -> None:
    # PyPI's Linux torchvision does not import beside a CPU-only torch: say so in one line, with the command that fixes
    # it, rather than a traceback.
    broken = models.broken_torchvision()
    if broken is not None:
        sys.exit(f"save_state_dict.py: torchvision does not import ({broken}); {models.torchvision_install()}")
    try:
        import torchvision
    except ImportError:
        sys.exit(f"save_state_dict.py: torchvision is not installed; install it with: {models.torchvision_install()}")
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = torchvision.models.resnet18(weights=None, num_classes=10)
    torch.save(model.state_dict(), out / "resnet18.pth")
    print(f"wrote {out / 'resnet18.pth'}")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "resnet18_out"))
