"""The ``train`` subcommand: ``halfserve train RECIPE [options]`` (also ``python -m halfserve.training RECIPE``).

Expected failures (unknown recipe, unwritable store, nothing to resume, bad option values) print one line on
stderr and exit with code 2, like argparse's own usage errors; a traceback means a bug.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from halfserve.precision import DTYPE_NAMES
from halfserve.storage import MANIFEST, StoreError
from halfserve.training.errors import TrainingError
from halfserve.training.recipes import RECIPES
from halfserve.training.trainer import TrainResult, train

EXIT_OK = 0
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
PROG = "halfserve train"
DESCRIPTION = """\
Train a bundled recipe on data that ships with scikit-learn and save it as a new numbered version in the model
store, with a report (report/metrics.json and loss, accuracy and loss-scale plots) and an evaluation of the saved
checkpoint served in fp32, fp16 and bf16 (written to the manifest's "evaluation").

examples:
  halfserve train digits_cnn                       # bf16 autocast on a CPU, fp16 + GradScaler on CUDA
  halfserve train digits_cnn --resume --epochs 4   # 4 more epochs from the newest version's train_state.pt
  halfserve train tabular --no-state               # no optimizer state beside the weights (the shipped store)

Expected errors print one line on stderr and exit with code 2."""


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``train`` on a parent CLI's subparsers; the parsed namespace's ``func`` runs it."""
    parser = subparsers.add_parser(
        "train",
        help="train a bundled recipe and save it as a new model store version",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``train`` options, on any parser; sets ``func`` to :func:`command`."""
    parser.add_argument("recipe", help=f"what to train: {', '.join(RECIPES)}")
    parser.add_argument(
        "--store", default="model_store", metavar="DIR", help="model store folder (default: %(default)s)"
    )
    parser.add_argument(
        "--precision",
        choices=list(DTYPE_NAMES),
        default=None,
        help="training autocast dtype (default: fp16 on CUDA, bf16 on CPU; fp16 on a CPU is very slow)",
    )
    parser.add_argument("--epochs", type=int, default=None, metavar="N", help="epochs to run (default: the recipe's)")
    parser.add_argument(
        "--max-steps", type=int, default=None, metavar="N", help="stop after N optimizer steps in this run"
    )
    parser.add_argument("--batch-size", type=int, default=None, metavar="N", help="default: the recipe's")
    parser.add_argument("--lr", type=float, default=None, help="AdamW learning rate (default: the recipe's)")
    parser.add_argument("--seed", type=int, default=0, help="seed for initialisation, shuffling, dropout")
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue from the highest existing version's train_state.pt; runs --epochs more and saves a new version",
    )
    parser.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when available)")
    parser.add_argument(
        "--no-state",
        dest="save_state",
        action="store_false",
        help="do not write train_state.pt (optimizer/scaler state) beside the weights; the version cannot be resumed",
    )
    parser.add_argument(
        "--no-progress", dest="progress", action="store_false", help="no progress bar (also off when stderr is no TTY)"
    )
    parser.set_defaults(func=command)


def command(args: argparse.Namespace) -> int:
    """Run a parsed ``train`` command; returns the exit code."""
    try:
        result = train(
            args.recipe,
            args.store,
            precision=args.precision,
            epochs=args.epochs,
            max_steps=args.max_steps,
            batch_size=args.batch_size,
            lr=args.lr,
            seed=args.seed,
            resume=args.resume,
            device=args.device,
            progress=args.progress,
            save_state=args.save_state,
        )
    except (TrainingError, StoreError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted; nothing was saved", file=sys.stderr)
        return EXIT_INTERRUPTED
    print(summary(result))
    return EXIT_OK


def summary(result: TrainResult) -> str:
    """A few human-readable lines about a finished run."""
    ev = result.evaluation
    training = result.manifest.training or {}
    accuracy = "  ".join(f"{name} {value:.2%}" for name, value in ev.accuracy.items())
    agreement = "  ".join(f"{name} {value:.2%}" for name, value in ev.agreement.items())
    lines = [
        f"{result.recipe} v{result.version} -> {result.version_dir}",
        f"  trained {training.get('precision')} on {training.get('device')}: {result.run_steps} steps "
        f"({result.steps} in total, {result.skipped_steps} skipped) in {result.seconds:.1f} s, "
        f"final loss {result.final_loss:.4f}",
        f"  test accuracy ({ev.test_samples} samples): {accuracy}",
        f"  top-1 agreement with fp32: {agreement}",
        f"  report: {result.version_dir / 'report'}",
    ]
    pinned = result.manifest.version
    if pinned is not None and pinned != result.version:
        lines.append(
            f'  {MANIFEST} pins version {pinned}: the server goes on serving it (remove its "version" to serve '
            f"v{result.version})"
        )
    if result.state_file is None:
        lines.append("  no train_state.pt written (--no-state): this version cannot be resumed")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m halfserve.training``."""
    parser = argparse.ArgumentParser(
        prog=PROG, description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(parser)
    args = parser.parse_args(argv)
    code: int = args.func(args)
    return code
