"""The ``loadtest`` subcommand: ``halfserve loadtest [options]`` (also ``python -m halfserve.loadtest``).

Expected failures (a remote URL, a model the server does not serve, a server that will not start, a bad input file)
print one line on stderr and exit with code 2; a traceback means a bug.

This module is imported by every ``halfserve`` command, so it imports only what parsing needs; the sweep, the
progress bar (rich) and the plot (matplotlib) are imported when ``loadtest`` runs.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from collections.abc import Sequence
from pathlib import Path

from halfserve.loadtest import LoadtestError
from halfserve.loadtest.config import DEFAULT_CONCURRENCY, PRECISIONS, LoadtestConfig, default_precisions
from halfserve.loadtest.payload import Protocol

EXIT_OK = 0
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
PROG = "halfserve loadtest"
DESCRIPTION = """\
Sweep concurrency against a model and report throughput (req/s, rows/s), latency (p50/p90/p99/max), errors and
the server's mean batch size per level, for each precision, with the half/fp32 throughput ratio. Writes
loadtest.json, loadtest.md and loadtest.png into --out and prints the table.

Without --url it starts `halfserve serve --models MODEL --precision P` on 127.0.0.1 and a free port once per
precision, waits for /ready, sweeps, and stops it. With --url it loads a running server (127.0.0.1 or localhost
only, unless --allow-remote) in whatever precision that server serves.

The load comes from a separate client process (httpx, one keep-alive connection and one request in flight per
virtual user, bodies encoded once). Its own ceiling is measured against GET /health and reported; for small models
on a small machine, wrk (benchmarks/serve_bench.py) is the load generator of record.

examples:
  halfserve loadtest --model resnet_bench                                  # bf16,fp32 on a CPU; fp16,fp32 on CUDA
  halfserve loadtest --model tabular --precisions bf16,fp32 --concurrency 1,8,32 --duration 5 --out results/tab
  halfserve loadtest --url http://127.0.0.1:8000 --model digits_mlp --protocol v2-binary --requests 2000

Expected errors print one line on stderr and exit with code 2."""


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _names(text: str) -> tuple[str, ...]:
    values = tuple(x.strip() for x in text.split(",") if x.strip())
    unknown = [v for v in values if v not in PRECISIONS]
    if not values or unknown:
        raise argparse.ArgumentTypeError(f"expected some of {','.join(PRECISIONS)}, got {text!r}")
    return values


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``loadtest`` on a parent CLI's subparsers; the parsed namespace's ``func`` runs it."""
    parser = subparsers.add_parser(
        "loadtest",
        help="sweep concurrency against a model per precision; JSON, table and plot",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``loadtest`` options, on any parser; sets ``func`` to :func:`command`."""
    target = parser.add_argument_group("what to load")
    target.add_argument("--url", help="a running server's base URL (default: start one per precision)")
    target.add_argument("--allow-remote", action="store_true", help="allow a --url host other than this machine")
    target.add_argument("--model", help="the model to load (default with --url: the only one served)")
    target.add_argument(
        "--store", type=Path, default=Path("model_store"), metavar="DIR", help="model store (default: %(default)s)"
    )
    target.add_argument(
        "--precisions",
        type=_names,
        metavar="LIST",
        help=f"precisions to sweep without --url, of {','.join(PRECISIONS)} (default: bf16,fp32 on a CPU, "
        "fp16,fp32 on CUDA)",
    )
    target.add_argument("--device", help="the started server's --device: auto, cpu, cuda, cuda:N (default: auto)")
    target.add_argument(
        "--serve-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra argument for the started `halfserve serve`, repeatable (e.g. --serve-arg=--max-delay-ms=5)",
    )

    load = parser.add_argument_group("the load")
    load.add_argument(
        "--concurrency",
        type=_ints,
        default=DEFAULT_CONCURRENCY,
        metavar="LIST",
        help=f"virtual users per level (default: {','.join(map(str, DEFAULT_CONCURRENCY))})",
    )
    amount = load.add_mutually_exclusive_group()
    amount.add_argument("--duration", type=float, metavar="S", help="seconds per level (default: 10)")
    amount.add_argument("--requests", type=int, metavar="N", help="requests per level, instead of --duration")
    load.add_argument(
        "--warmup", type=float, default=1.0, metavar="S", help="unmeasured seconds before each level (default: 1)"
    )
    load.add_argument(
        "--protocol",
        type=Protocol,
        choices=list(Protocol),
        default=Protocol.PREDICT,
        help="predict (POST /predict), v2-json or v2-binary (POST /v2/models/MODEL/infer), grpc (ModelInfer with "
        "raw tensors) (default: predict)",
    )
    load.add_argument(
        "--grpc-url",
        metavar="HOST:PORT",
        help="a --url server's gRPC address for --protocol grpc (default: its host, port 8001)",
    )
    load.add_argument("--input", type=Path, metavar="FILE", help="JSON list of samples (default: random data)")
    load.add_argument("--rows-per-request", type=int, default=1, metavar="N", help="samples per request (default: 1)")
    load.add_argument("--seed", type=int, default=0, help="seed of the random samples (default: 0)")
    load.add_argument("--timeout", type=float, default=30.0, metavar="S", help="per request as a whole (default: 30)")

    client = parser.add_argument_group("the client")
    client.add_argument(
        "--client-processes",
        type=int,
        default=1,
        metavar="N",
        help="load-generating processes sharing the virtual users (default: 1; more only where there are spare cores)",
    )
    client.add_argument(
        "--client-ceiling",
        type=float,
        default=3.0,
        metavar="S",
        help="seconds of GET /health at the top concurrency to measure the client's ceiling; 0 skips (default: 3)",
    )
    client.add_argument(
        "--loop",
        choices=["uvloop", "asyncio"],
        default="uvloop",
        help="client event loop (default: uvloop if installed)",
    )

    output = parser.add_argument_group("output")
    output.add_argument(
        "--out", type=Path, default=Path("loadtest_results"), metavar="DIR", help="output folder (default: %(default)s)"
    )
    output.add_argument(
        "--no-progress", dest="progress", action="store_false", help="no progress bar (also off when stderr is no TTY)"
    )
    parser.set_defaults(func=command)


def config_from_args(args: argparse.Namespace) -> LoadtestConfig:
    """A validated :class:`LoadtestConfig` from parsed arguments."""
    if args.url is not None and (args.precisions is not None or args.device is not None or args.serve_arg):
        raise LoadtestError(
            "--precisions, --device and --serve-arg apply when the load test starts the server; "
            "a server given by --url serves the precision it was started with"
        )
    precisions = args.precisions
    if args.url is None and precisions is None:
        precisions = default_precisions(args.device)
    duration = args.duration if args.duration is not None or args.requests is not None else 10.0
    return LoadtestConfig(
        model=args.model,
        url=args.url,
        store=args.store,
        precisions=tuple(precisions or ()),
        concurrency=tuple(args.concurrency),
        duration=duration,
        requests=args.requests,
        warmup=args.warmup,
        protocol=args.protocol,
        grpc_url=args.grpc_url,
        input_file=args.input,
        rows_per_request=args.rows_per_request,
        out=args.out,
        device=args.device,
        progress=args.progress,
        allow_remote=args.allow_remote,
        timeout=args.timeout,
        client_processes=args.client_processes,
        client_ceiling=args.client_ceiling,
        loop=args.loop,
        seed=args.seed,
        server_args=tuple(args.serve_arg),
    )


OPTIONAL_DEPENDENCIES = ("rich", "matplotlib")


def command(args: argparse.Namespace) -> int:
    """Run a parsed ``loadtest`` command; returns the exit code."""
    missing = [name for name in OPTIONAL_DEPENDENCIES if importlib.util.find_spec(name) is None]
    if missing:
        print(
            f"{PROG}: error: needs {' and '.join(missing)} (pip install 'halfserve[train]'), which serving does not",
            file=sys.stderr,
        )
        return EXIT_USAGE
    try:
        config = config_from_args(args)
    except LoadtestError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return EXIT_USAGE

    from rich.console import Console

    from halfserve.loadtest import report
    from halfserve.loadtest.progress import SweepProgress
    from halfserve.loadtest.runner import Runner

    runner: Runner | None = None
    try:
        with SweepProgress(enabled=config.progress) as progress:
            runner = Runner(config, progress)
            sweep = runner.run()
        paths = report.write(sweep, config.out)
    except LoadtestError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        if runner is None or not runner.sweep.results:
            print(f"{PROG}: interrupted; nothing was written", file=sys.stderr)
        else:
            runner.sweep.finish()
            paths = report.write(runner.sweep, config.out)
            print(f"{PROG}: interrupted; the levels measured so far are in {paths['json']}", file=sys.stderr)
        return EXIT_INTERRUPTED
    console = Console()
    if not console.is_terminal:
        # Piped or captured output: keep every column rather than squeezing the table into 80 characters.
        console = Console(width=200)
    report.print_summary(sweep, console)
    print(f"wrote {paths['json']}, {paths['table']}, {paths['plot']}")
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m halfserve.loadtest``."""
    parser = argparse.ArgumentParser(
        prog=PROG, description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(parser)
    args = parser.parse_args(argv)
    code: int = args.func(args)
    return code
