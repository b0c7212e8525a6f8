"""The training report: what happened at every step and epoch, as JSON and as PNG plots.

Written to ``<version_dir>/report/``:

- ``metrics.json``: one entry per optimizer step (loss, loss scale, skipped, gradient norm), one per epoch (train
  loss and accuracy, test accuracy), the final numbers and the half-precision evaluation;
- ``loss.png``, ``accuracy.png``, ``loss_scale.png``.

When a run resumes, the previous version's history is carried over, so each version's report shows the whole chain.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.figure import Figure

REPORT_DIR = "report"
METRICS_FILE = "metrics.json"
PLOT_FILES = ("loss.png", "accuracy.png", "loss_scale.png")
DPI = 100


def finite_or_none(value: float, digits: int = 7) -> float | None:
    """``value`` to ``digits`` significant digits, or ``None`` when it is inf/NaN (strict JSON has no spelling for
    those). Seven digits keep fp32's resolution and halve the size of the per-step records."""
    return float(f"{value:.{digits}g}") if math.isfinite(value) else None


@dataclass
class History:
    """Per-step and per-epoch records of a training chain."""

    steps: list[dict[str, Any]] = field(default_factory=list)
    epochs: list[dict[str, Any]] = field(default_factory=list)

    def record_step(
        self, *, step: int, epoch: int, loss: float, loss_scale: float, skipped: bool, grad_norm: float, lr: float
    ) -> None:
        self.steps.append(
            {
                "step": step,
                "epoch": epoch,
                "loss": finite_or_none(loss),
                "loss_scale": loss_scale,
                "skipped": skipped,
                "grad_norm": finite_or_none(grad_norm),
                "lr": finite_or_none(lr),
            }
        )

    def record_epoch(
        self, *, epoch: int, steps: int, train_loss: float, train_accuracy: float, test_accuracy: float, partial: bool
    ) -> None:
        self.epochs.append(
            {
                "epoch": epoch,
                "steps": steps,
                "train_loss": finite_or_none(train_loss),
                "train_accuracy": finite_or_none(train_accuracy),
                "test_accuracy": finite_or_none(test_accuracy),
                "partial": partial,
            }
        )

    @classmethod
    def load(cls, version_dir: Path) -> History:
        """The history in ``<version_dir>/report/metrics.json``; empty when there is none or it is unreadable."""
        try:
            raw = json.loads((version_dir / REPORT_DIR / METRICS_FILE).read_text())
            steps, epochs = raw["steps"], raw["epochs"]
        except (OSError, ValueError, KeyError, TypeError):
            return cls()
        if not (isinstance(steps, list) and isinstance(epochs, list)):
            return cls()
        return cls(steps=list(steps), epochs=list(epochs))


def write(version_dir: Path, history: History, summary: dict[str, Any]) -> list[Path]:
    """Write ``metrics.json`` (``summary`` merged in at the top level) and the plots; returns the files written."""
    # The object-oriented Figure API draws with the Agg canvas and touches no global pyplot state or GUI backend.
    # Imported here: matplotlib is an optional (``train``) dependency that serving must not need.
    from matplotlib.figure import Figure

    out = version_dir / REPORT_DIR
    out.mkdir(parents=True, exist_ok=True)
    metrics = out / METRICS_FILE
    metrics.write_text(_dumps({**summary, "epochs": history.epochs, "steps": history.steps}))
    title = f"{summary.get('recipe', '')} v{summary.get('version', '')} ({summary.get('precision', '')})".strip()
    paths = [metrics]
    for name, draw in zip(PLOT_FILES, (_plot_loss, _plot_accuracy, _plot_loss_scale), strict=True):
        fig = Figure(figsize=(6.4, 4.0), dpi=DPI, layout="constrained")
        draw(fig, history, title)
        path = out / name
        fig.savefig(path, dpi=DPI)
        paths.append(path)
    return paths


def _dumps(document: dict[str, Any]) -> str:
    """Indented JSON with one line per step and per epoch: a third of the size, and still greppable by step."""
    parts = []
    for key, value in document.items():
        if key in ("steps", "epochs") and value:
            rows = ",\n".join("    " + json.dumps(row, allow_nan=False) for row in value)
            parts.append(f"  {json.dumps(key)}: [\n{rows}\n  ]")
        else:
            body = json.dumps(value, indent=2, allow_nan=False).replace("\n", "\n  ")
            parts.append(f"  {json.dumps(key)}: {body}")
    return "{\n" + ",\n".join(parts) + "\n}\n"


def _moving_mean(values: tuple[float, ...], window: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def _skipped_steps(history: History) -> list[int]:
    return [s["step"] for s in history.steps if s["skipped"]]


def _plot_loss(fig: Figure, history: History, title: str) -> None:
    ax = fig.add_subplot()
    points = [(s["step"], s["loss"]) for s in history.steps if s["loss"] is not None]
    if points:
        xs, ys = zip(*points, strict=True)
        ax.plot(xs, ys, lw=0.8, alpha=0.45, color="tab:blue", label="loss per step")
        window = max(1, len(ys) // 25)
        if window > 1:
            ax.plot(xs, _moving_mean(ys, window), lw=1.6, color="tab:blue", label=f"moving mean ({window} steps)")
        if min(ys) > 0 and max(ys) / min(ys) > 20:
            ax.set_yscale("log")
    for i, step in enumerate(_skipped_steps(history)):
        label = "skipped step (non-finite gradient)" if i == 0 else None
        ax.axvline(step, color="tab:red", lw=0.8, alpha=0.6, label=label)
    ax.set(title=f"Training loss: {title}", xlabel="optimizer step", ylabel="cross-entropy")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right", fontsize="small")


def _plot_accuracy(fig: Figure, history: History, title: str) -> None:
    ax = fig.add_subplot()
    epochs = [e["epoch"] for e in history.epochs]
    ax.plot(
        epochs, [e["train_accuracy"] for e in history.epochs], "o-", ms=3, label="train (running, in training mode)"
    )
    ax.plot(epochs, [e["test_accuracy"] for e in history.epochs], "s-", ms=3, label="test (fp32, eval mode)")
    if history.epochs:
        last = history.epochs[-1]
        ax.annotate(
            f"{last['test_accuracy']:.2%}",
            (last["epoch"], last["test_accuracy"]),
            textcoords="offset points",
            xytext=(-10, -14),
            ha="right",
            fontsize="small",
        )
    ax.set(title=f"Accuracy per epoch: {title}", xlabel="epoch", ylabel="accuracy", ylim=(None, 1.005))
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize="small")


def _plot_loss_scale(fig: Figure, history: History, title: str) -> None:
    ax = fig.add_subplot()
    xs = [s["step"] for s in history.steps]
    scales = [s["loss_scale"] for s in history.steps]
    ax.step(xs, scales, where="post", color="tab:green", label="loss scale used by the step")
    skipped = [(s["step"], s["loss_scale"]) for s in history.steps if s["skipped"]]
    if skipped:
        sx, sy = zip(*skipped, strict=True)
        ax.plot(sx, sy, "x", color="tab:red", label=f"skipped step ({len(skipped)})")
    if scales and all(s == 1.0 for s in scales):
        ax.set_ylim(0, 2)
        ax.text(
            0.5,
            0.75,
            "GradScaler disabled (bf16/fp32): no loss scaling",
            transform=ax.transAxes,
            ha="center",
            fontsize="small",
            bbox={"facecolor": "white", "edgecolor": "0.8"},
        )
    elif scales:
        ax.set_yscale("log", base=2)
    ax.set(title=f"Loss scale: {title}", xlabel="optimizer step", ylabel="scale")
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize="small")
