"""The training run: the epoch loop, then a new store version with its state, evaluation and report.

A run either starts fresh or resumes from the highest version of its recipe in the store. Either way it writes a
*new* numbered version, so a served version is never overwritten; the new version's training record counts steps
and epochs over the whole chain.

The learning rate follows :func:`~halfserve.training.step.cosine_lr` over the run's steps; a resumed run starts a new
decay (a warm restart), since how many more runs will follow is unknown.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from pydantic import ValidationError
from torch import nn

from halfserve import storage, store
from halfserve.manifest import Manifest, describe, load_manifest
from halfserve.precision import grad_scaler
from halfserve.storage import StoreError
from halfserve.training import checkpoint, evaluation, report
from halfserve.training.checkpoint import TrainState
from halfserve.training.config import TrainConfig, check_dependencies, check_writable
from halfserve.training.datasets import Dataset
from halfserve.training.errors import TrainingError
from halfserve.training.evaluation import Evaluation
from halfserve.training.recipes import Recipe
from halfserve.training.report import History
from halfserve.training.standardization import fold, unfold
from halfserve.training.step import cosine_lr, train_step

if TYPE_CHECKING:
    from rich.progress import Progress


@dataclass(frozen=True)
class TrainResult:
    """What a training run produced."""

    recipe: str
    version: int
    version_dir: Path
    manifest: Manifest
    evaluation: Evaluation
    steps: int
    """Optimizer steps over the whole chain (this run plus the runs it resumed from)."""
    run_steps: int
    skipped_steps: int
    final_loss: float
    seconds: float
    """Training wall time of this run (evaluation and writing excluded)."""
    report_files: list[Path]
    state_file: Path | None


def train(
    recipe: str | Recipe,
    store: Path | str = "model_store",
    *,
    precision: str | None = None,
    epochs: int | None = None,
    max_steps: int | None = None,
    batch_size: int | None = None,
    lr: float | None = None,
    seed: int = 0,
    resume: bool = False,
    device: str | torch.device | None = None,
    progress: bool = False,
    save_state: bool = True,
) -> TrainResult:
    """Train ``recipe`` and save it as a new version in the model store at ``store``.

    ``precision`` is the training autocast dtype name (default: fp16 on CUDA, bf16 on a CPU). ``epochs``,
    ``batch_size`` and ``lr`` default to the recipe's; ``max_steps`` cuts the run short. ``resume`` continues from
    the highest existing version's ``train_state.pt`` for ``epochs`` more epochs; ``save_state=False`` writes no
    state (the version cannot be resumed). Raises :class:`TrainingError` for anything the caller can fix.
    """
    config = TrainConfig.create(
        recipe,
        store,
        precision=precision,
        epochs=epochs,
        max_steps=max_steps,
        batch_size=batch_size,
        lr=lr,
        seed=seed,
        resume=resume,
        device=device,
        progress=progress,
        save_state=save_state,
    )
    return run(config)


def run(config: TrainConfig) -> TrainResult:
    """Carry out a resolved :class:`TrainConfig`."""
    check_dependencies()
    check_writable(config.store)
    data = config.recipe.load_data()
    # Seeding is the run's business, not the caller's: the global RNG is restored afterwards.
    cuda = []
    if config.device.type == "cuda":
        cuda = [config.device.index if config.device.index is not None else torch.cuda.current_device()]
    with torch.random.fork_rng(devices=cuda):
        return _Run(config, data).execute()


@dataclass
class _Counters:
    """Where the loop is, over the whole chain (``step``, ``epoch``, ``skipped``) and in this run."""

    step: int
    skipped: int
    epoch: int
    run_steps: int = 0
    last_loss: float = float("nan")

    def count(self, loss: float, skipped: bool) -> None:
        self.step += 1
        self.run_steps += 1
        self.skipped += skipped
        self.last_loss = loss


KEPT_SETTINGS = frozenset(
    {
        "version",
        "precision",
        "overflow",
        "min_agreement",
        "fidelity",
        "padding_invariant",
        "allow_nonfinite_inputs",
        "batching",
        "execution",
        "handler",
        "answer",
    }
)
"""A manifest's fields that say how its model is served, not what the recipe trains: set by the operator (a version
pin, a precision, batching, a fidelity bar, ...), a new version keeps them."""


def operator_settings(root: Path, name: str) -> dict[str, Any]:
    """The serving settings (:data:`KEPT_SETTINGS`) of the manifest the store holds for ``name``, as JSON; none for a
    model not in the store yet. A manifest that cannot be read is a :class:`TrainingError`: the run would overwrite
    what the operator wrote in it."""
    model_dir = root / name
    if not (model_dir / storage.MANIFEST).is_file():
        return {}
    try:
        existing = load_manifest(model_dir)
    except StoreError as e:
        raise TrainingError(
            f"{e}; fix it, or move it away for the recipe's own, before training a new version"
        ) from None
    kept: dict[str, Any] = existing.model_dump(mode="json", include=set(KEPT_SETTINGS), exclude_none=True)
    return kept


class _Run:
    def __init__(self, config: TrainConfig, data: Dataset) -> None:
        self.config = config
        self.data = data
        self.recipe = config.recipe
        self.standardize = self.recipe.preprocessor(data)
        self.previous: TrainState | None = None
        self.previous_version: int | None = None
        self.kept = operator_settings(config.store, self.recipe.name)  # before training: an unreadable one stops it
        try:
            storage.next_version(config.store / self.recipe.name)  # as is no number left for the new version
        except StoreError as e:
            raise TrainingError(str(e)) from None
        if config.resume:
            self.module, self.history = self._resume()
        else:
            torch.manual_seed(config.seed)
            self.module, self.history = self.recipe.build(), History()
        self.model: nn.Module = (
            nn.Sequential(self.standardize, self.module) if self.standardize is not None else self.module
        ).to(config.device)
        self.optimizer = torch.optim.AdamW(
            self.module.parameters(), lr=config.lr, weight_decay=self.recipe.weight_decay
        )
        self.scaler = grad_scaler(config.dtype, config.device)
        if self.previous is not None:
            try:
                self.optimizer.load_state_dict(self.previous.optimizer)
                # A state from a bf16/fp32 run has no scale to restore; fp16 then starts from the default scale.
                if self.scaler.is_enabled() and self.previous.scaler:
                    self.scaler.load_state_dict(self.previous.scaler)
            except (ValueError, KeyError, TypeError, RuntimeError) as e:
                where = config.store / self.recipe.name / str(self.previous_version) / checkpoint.STATE_FILE
                raise TrainingError(f"{where}: optimizer/scaler state does not fit the model ({e})") from None

    def _manifest(self, **extra: Any) -> Manifest:
        """The recipe's manifest (``extra`` fills ``training`` / ``evaluation``) with the store's serving settings
        kept (:func:`operator_settings`)."""
        fresh = self.recipe.manifest(self.data, **extra)
        if not self.kept:
            return fresh
        where = self.config.store / self.recipe.name / storage.MANIFEST
        try:
            return Manifest.model_validate({**fresh.model_dump(mode="json", exclude_none=True), **self.kept})
        except ValidationError as e:
            raise TrainingError(
                f"{where}: its settings do not fit recipe {self.recipe.name!r}: {describe(e)}"
            ) from None

    def _resume(self) -> tuple[nn.Module, History]:
        root, name = self.config.store, self.recipe.name
        model_dir = root / name
        present = storage.versions(model_dir) if model_dir.is_dir() else []
        if not present:
            raise TrainingError(f"{model_dir}: no version of {name!r} to resume from")
        version = present[-1]
        vdir = model_dir / str(version)
        state = checkpoint.load(vdir)
        if state.recipe != name:
            raise TrainingError(f"{vdir / checkpoint.STATE_FILE}: recipe: state is for {state.recipe!r}, not {name!r}")
        loaded = store.load(root, name, version)
        expected = self.recipe.manifest(self.data)
        if (loaded.manifest.architecture, loaded.manifest.arch_kwargs) != (expected.architecture, expected.arch_kwargs):
            raise TrainingError(
                f"{model_dir / storage.MANIFEST}: architecture: {loaded.manifest.architecture} "
                f"{loaded.manifest.arch_kwargs} differs from recipe {name!r}'s {expected.arch_kwargs}"
            )
        module = loaded.module.train()
        if self.standardize is not None:
            unfold(self.standardize, module)
        # A different seed per resumed step keeps dropout masks from repeating those of the first run.
        torch.manual_seed(self.config.seed + state.step)
        self.previous, self.previous_version = state, version
        return module, History.load(vdir)

    def execute(self) -> TrainResult:
        config, data = self.config, self.data
        x_train, y_train = data.x_train.to(config.device), data.y_train.to(config.device)
        x_test, y_test = data.x_test.to(config.device), data.y_test.to(config.device)
        batch_size = min(config.batch_size, x_train.shape[0])
        per_epoch = x_train.shape[0] // batch_size  # drop the ragged tail: BatchNorm needs full, even batches
        total = config.epochs * per_epoch
        if config.max_steps is not None:
            total = min(total, config.max_steps)
        first_epoch = self.previous.epoch if self.previous else 0
        counters = _Counters(
            step=self.previous.step if self.previous else 0,
            skipped=self.previous.skipped_steps if self.previous else 0,
            epoch=first_epoch,
        )

        started = time.perf_counter()
        with _progress(config.progress) as progress:
            task = progress.add_task(f"{self.recipe.name} [{config.precision}]", total=total, info="")
            for epoch in range(first_epoch + 1, first_epoch + config.epochs + 1):
                if counters.run_steps >= total:
                    break
                # Shuffled by (seed, epoch) alone, so a resumed chain sees the same order a single run would.
                shuffle = torch.Generator().manual_seed(config.seed * 10_000 + epoch)
                order = torch.randperm(x_train.shape[0], generator=shuffle)
                batches = [order[i * batch_size : (i + 1) * batch_size] for i in range(per_epoch)]
                batches = batches[: total - counters.run_steps]
                self.model.train()
                seen = correct = 0
                loss_sum = 0.0
                for idx in batches:
                    lr = cosine_lr(config.lr, counters.run_steps, total)
                    for group in self.optimizer.param_groups:
                        group["lr"] = lr
                    idx = idx.to(config.device)
                    result = train_step(
                        self.model,
                        x_train[idx],
                        y_train[idx],
                        self.optimizer,
                        self.scaler,
                        dtype=config.dtype,
                        device=config.device,
                        max_grad_norm=self.recipe.max_grad_norm,
                    )
                    counters.count(result.loss, result.skipped)
                    if not math.isfinite(result.loss) and not self.scaler.is_enabled():
                        raise TrainingError(
                            f"loss became {result.loss} at step {counters.step}: lower --lr or use fp32"
                        )
                    seen, correct, loss_sum = (
                        seen + idx.numel(),
                        correct + result.correct,
                        loss_sum + result.loss * idx.numel(),
                    )
                    self.history.record_step(
                        step=counters.step,
                        epoch=epoch,
                        loss=result.loss,
                        loss_scale=result.loss_scale,
                        skipped=result.skipped,
                        grad_norm=result.grad_norm,
                        lr=lr,
                    )
                    info = f"epoch {epoch} loss {result.loss:.4f} scale {result.loss_scale:g}"
                    progress.update(task, advance=1, info=info)
                self.history.record_epoch(
                    epoch=epoch,
                    steps=counters.step,
                    train_loss=loss_sum / max(seen, 1),
                    train_accuracy=correct / max(seen, 1),
                    test_accuracy=self._test_accuracy(x_test, y_test),
                    partial=len(batches) < per_epoch,
                )
                counters.epoch = epoch
        return self._finish(counters, time.perf_counter() - started)

    @torch.inference_mode()
    def _test_accuracy(self, x: torch.Tensor, y: torch.Tensor) -> float:
        self.model.eval()
        correct = sum(
            int((self.model(x[i : i + 512]).argmax(dim=1) == y[i : i + 512]).sum()) for i in range(0, x.shape[0], 512)
        )
        return correct / max(x.shape[0], 1)

    def _finish(self, c: _Counters, seconds: float) -> TrainResult:
        config, data, recipe = self.config, self.data, self.recipe
        module = self.module.cpu()
        if self.standardize is not None:
            fold(self.standardize.cpu(), module)
        total_seconds = seconds + (self.previous.seconds if self.previous else 0.0)
        first_epoch = self.previous.epoch if self.previous else 0
        last_epoch = self.history.epochs[-1] if self.history.epochs else {}
        training: dict[str, Any] = {
            "recipe": recipe.name,
            "precision": config.precision,
            "device": str(config.device),
            "optimizer": "AdamW",
            "lr": config.lr,
            "lr_schedule": "cosine decay to 0.1 x lr over the run's steps",
            "weight_decay": recipe.weight_decay,
            "batch_size": min(config.batch_size, data.x_train.shape[0]),
            "max_grad_norm": recipe.max_grad_norm,
            "seed": config.seed,
            "epochs": c.epoch,
            "steps": c.step,
            "skipped_steps": c.skipped,
            "final_loss": report.finite_or_none(c.last_loss),
            "final_epoch_train_loss": last_epoch.get("train_loss"),
            "final_train_accuracy": last_epoch.get("train_accuracy"),
            "final_test_accuracy": last_epoch.get("test_accuracy"),
            "seconds": round(total_seconds, 3),
            "run": {"epochs": c.epoch - first_epoch, "steps": c.run_steps, "seconds": round(seconds, 3)},
            "torch": torch.__version__,
        }
        if self.standardize is not None:
            training["standardization"] = "train-split mean/std folded into the first Linear; inputs are raw features"
        if self.previous_version is not None:
            training["resumed_from_version"] = self.previous_version
        try:
            version_dir = store.save(config.store, self._manifest(training=training), module)
        except (OSError, StoreError) as e:
            raise TrainingError(f"cannot save to model store {config.store}: {e}") from None
        version = int(version_dir.name)
        state_file = None
        if config.save_state:
            state = TrainState(
                recipe=recipe.name,
                precision=config.precision,
                epoch=c.epoch,
                step=c.step,
                skipped_steps=c.skipped,
                seed=config.seed,
                seconds=total_seconds,
                optimizer=self.optimizer.state_dict(),
                scaler=self.scaler.state_dict(),
            )
            state_file = checkpoint.save(version_dir, state)

        result = evaluation.evaluate(config.store, recipe.name, version, data.x_test, data.y_test, config.device)
        manifest = self._manifest(training=training, evaluation=result.as_dict())
        store.write_manifest(config.store, manifest)
        files = report.write(
            version_dir,
            self.history,
            {
                "recipe": recipe.name,
                "version": version,
                "precision": config.precision,
                "training": training,
                "evaluation": result.as_dict(),
            },
        )
        return TrainResult(
            recipe=recipe.name,
            version=version,
            version_dir=version_dir,
            manifest=manifest,
            evaluation=result,
            steps=c.step,
            run_steps=c.run_steps,
            skipped_steps=c.skipped,
            final_loss=c.last_loss,
            seconds=seconds,
            report_files=files,
            state_file=state_file,
        )


@contextmanager
def _progress(enabled: bool) -> Iterator[Progress]:
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    # A bar on a non-terminal (CI logs, pipes) only produces noise.
    console = Console(stderr=True)
    with Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
        disable=not (enabled and sys.stderr.isatty()),
    ) as progress:
        yield progress
