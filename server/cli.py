"""The ``halfserve`` command: ``serve``, ``train`` and ``loadtest``."""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import socket
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from server.loadtest import cli as loadtest_cli
from server.precision import Precision
from server.settings import LogFormat
from server.training import cli as train_cli

if TYPE_CHECKING:
    from server.multiproc.supervisor import Frontends


def _add_serve(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "serve",
        help="serve the models of a model store over HTTP",
        description="Serve a model store. Every flag has a HALFSERVE_<FLAG> environment variable; flags win.",
    )
    p.add_argument("--store", help="model store folder (default: model_store)")
    p.add_argument(
        "--code-path",
        type=Path,
        action="append",
        metavar="DIR",
        help="a folder put on the import path for 'module:factory' architectures (repeatable)",
    )
    p.add_argument("--models", help="comma-separated subset of the store's models to serve")
    p.add_argument("--host", help="address to bind (default: 127.0.0.1)")
    p.add_argument("--port", type=int, help="port (default: 8000)")
    p.add_argument("--grpc-port", type=int, help="port of the KServe V2 gRPC service (default: 8001)")
    p.add_argument(
        "--grpc", action=argparse.BooleanOptionalAction, default=None, help="serve KServe V2 over gRPC (default: on)"
    )
    p.add_argument("--device", help="auto, cpu, cuda or cuda:N (default: auto)")
    p.add_argument(
        "--precision",
        choices=[x.value for x in Precision],
        help="override every model's precision; fp32 is the fallback switch",
    )
    p.add_argument("--max-batch-size", type=int, help="override every model's max_batch_size")
    p.add_argument("--max-delay-ms", type=float, help="override every model's max_delay_ms")
    p.add_argument("--max-queue-rows", type=int, help="override every model's max_queue_rows")
    p.add_argument(
        "--adaptive-delay",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="override every model's adaptive_delay: an idle model waits no longer than its recent batches took, "
        "nor once its clients are back",
    )
    p.add_argument(
        "--request-timeout-ms",
        type=float,
        help="override every model's request_timeout_ms: a request not started by then is answered 504",
    )
    p.add_argument("--max-body-bytes", type=int, help="largest request body accepted, else 413 (default: 64 MiB)")
    p.add_argument(
        "--max-request-rows", type=int, help="most rows per inference request (default: the model's max_batch_size)"
    )
    p.add_argument("--max-request-elements", type=int, help="most input values per inference request (default: 2^24)")
    p.add_argument(
        "--max-json-values", type=int, help="most values and containers in a JSON request body (default: 2^19)"
    )
    p.add_argument(
        "--max-compression-ratio",
        type=float,
        help="how many times its size a gzip/deflate body may inflate to past its first MiB, else 413 (default: 100)",
    )
    p.add_argument("--header-timeout", type=float, help="seconds to send a request's headers, else 408 (default: 10)")
    p.add_argument("--body-timeout", type=float, help="seconds a body may stall between bytes, else 408 (default: 30)")
    p.add_argument(
        "--min-body-rate",
        type=int,
        help="bytes/s a body must average after its first body-timeout seconds, else 408 (default: 16384)",
    )
    p.add_argument("--max-url-bytes", type=int, help="longest request target, else 414 (default: 8192)")
    p.add_argument("--max-header-bytes", type=int, help="most header bytes per request, else 431 (default: 65536)")
    p.add_argument("--max-connections", type=int, help="open connections per process, else 503 (default: 1024)")
    p.add_argument(
        "--allowed-hosts",
        help="comma-separated names the Host header may carry besides IP addresses, localhost and --host; "
        "*.example.com for subdomains, * for any; else 400",
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        help="seconds a shutdown waits for requests in flight before cancelling them (default: 30)",
    )
    p.add_argument(
        "--http-workers",
        type=int,
        help="HTTP front-end processes feeding this process's engines (default: 1, no front-ends); for GPU hosts",
    )
    p.add_argument("--threads", type=int, help="torch intra-op threads (default: one per core)")
    p.add_argument(
        "--instance-isolation",
        choices=["thread", "process"],
        help="run engine instances as threads of this process or as processes of their own (default: the manifest's "
        "execution.isolation, else processes on CUDA and threads on a CPU)",
    )
    p.add_argument(
        "--gil-switch-interval-ms",
        type=float,
        help="the interpreter's thread switch interval (default: 0.5 on CUDA, Python's 5 elsewhere)",
    )
    p.add_argument(
        "--forward-on-event-loop",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run CPU batches on the event loop's thread (default: where a full batch's forward is shorter than the "
        "loop's work on its requests, on one thread)",
    )
    p.add_argument(
        "--pipeline-forward",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run CPU batches as a traced graph beside the event loop, two in flight (default: where the forward would "
        "run on the loop and takes 10%% or more of the loop's work on a full batch of 32+ rows, if the model traces)",
    )
    p.add_argument(
        "--tf32",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="let fp32 use TF32 on Ampere+ GPUs (default: off, fp32 is IEEE fp32)",
    )
    p.add_argument(
        "--admin-token",
        help="bearer token that enables the management calls; shows in ps: prefer HALFSERVE_ADMIN_TOKEN or the file",
    )
    p.add_argument("--admin-token-file", type=Path, help="file holding the admin token (a mounted secret)")
    p.add_argument("--no-warmup", dest="warmup", action="store_false", default=None, help="skip warm-up at load")
    p.add_argument("--no-docs", dest="docs", action="store_false", default=None, help="serve no Swagger UI at /docs")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    p.add_argument("--log-format", choices=[f.value for f in LogFormat], help="text (default) or json, one per line")
    p.add_argument("--access-log", action="store_true", default=None, help="log every request (slower)")
    p.set_defaults(func=serve)


def serve(args: argparse.Namespace) -> int:
    from server import logs, models, store
    from server.app import begin_drain, create_app
    from server.multiproc.supervisor import Frontends
    from server.repository import ModelRepository
    from server.settings import Settings
    from server.transport import DrainingServer, uvicorn_config

    fields = set(Settings.model_fields)
    given = {k: v for k, v in vars(args).items() if k in fields and v is not None}
    try:
        settings = Settings(**given)
        models.add_code_path(settings.code_path)
        # Validate every manifest and architecture before binding the port, so a bad store fails with the file and
        # field named.
        ModelRepository(settings).discover()
    except (ValidationError, store.StoreError, ValueError, models.UnknownArchitectureError) as e:
        print(f"halfserve serve: {e}", file=sys.stderr)
        return 2
    log_config = logs.configure(settings.log_format, settings.log_level, settings.access_log)
    if args.admin_token is not None:
        logging.getLogger(__name__).warning(
            "--admin-token shows in the process list (ps, /proc); pass HALFSERVE_ADMIN_TOKEN or --admin-token-file"
        )
    frontends: Frontends | None = None
    where: dict[str, Any] = {"host": settings.host, "port": settings.port}
    if settings.http_workers > 1:
        # The front-ends share the listening socket; this process serves its API to them on a Unix socket.
        frontends = Frontends(settings, listen(settings.host, settings.port), tempfile.mkdtemp(prefix="halfserve-"))
        where = {"uds": frontends.api_socket}
    app = create_app(settings, frontends)
    config = uvicorn_config(app, settings, log_config, app.direct_routes(), **where)

    def remove_temporary_files() -> None:
        if frontends is not None:
            shutil.rmtree(os.path.dirname(frontends.api_socket), ignore_errors=True)

    try:
        DrainingServer(config, lambda: begin_drain(app), remove_temporary_files).run()
    finally:
        remove_temporary_files()  # also when the server failed to start
    return 0


def listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` that spawned processes can inherit."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _add_import(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "import",
        help="turn a state dict, a safetensors file or a Hugging Face folder into a model store entry",
        description="Build the architecture, load SOURCE's weights strictly, derive the outputs (unless given), store "
        "calibration samples and measure half precision against fp32 on them, and write the next version of NAME.",
    )
    p.add_argument("source", type=Path, help=".pt/.pth state dict, .safetensors file, or Hugging Face model folder")
    p.add_argument("--name", required=True, help="the model's name in the store")
    p.add_argument(
        "--architecture",
        required=True,
        help="registered name, package.module:factory, torchvision:<builder> or transformers:<AutoClass>",
    )
    p.add_argument("--arch-kwargs", help="JSON object of the factory's keyword arguments")
    p.add_argument(
        "--input", action="append", required=True, metavar="NAME:DTYPE:SHAPE", help="e.g. image:FP32:3x224x224"
    )
    p.add_argument(
        "--input-format",
        metavar="FORMAT",
        help="NCHW, NHWC or NONE: the layout of the image inputs (three dimensions), as Triton's model config reports "
        "it to clients; default: from the shape where unambiguous (3x224x224 is NCHW, 224x224x3 NHWC)",
    )
    p.add_argument("--output", action="append", metavar="NAME:DTYPE:SHAPE", help="default: from one forward")
    p.add_argument("--max-length", type=int, help="the longest length of variable (-1) inputs")
    p.add_argument("--mask", metavar="NAME", help="an attention mask input the server builds for the variable input")
    p.add_argument("--text", metavar="NAME", help="a text input tokenized with the folder's tokenizer.json")
    p.add_argument("--labels", type=Path, help="text file with one class name per line (the first output's)")
    p.add_argument("--calibration", type=Path, help=".npy (one input), .npz or .safetensors samples by input name")
    p.add_argument("--samples", type=int, default=64, help="random calibration samples without --calibration")
    p.add_argument("--min-agreement", type=float, help="serve in fp32 below this top-1 agreement (the manifest's)")
    p.add_argument("--store", type=Path, default=Path("model_store"), help="model store folder (default: model_store)")
    p.add_argument("--code-path", type=Path, action="append", metavar="DIR", help="folder for module:factory code")
    p.add_argument("--device", default="auto", help="where the half-precision agreement is measured")
    p.set_defaults(func=import_)


def import_(args: argparse.Namespace) -> int:
    from server import importer, models, store
    from server.engine import resolve_device

    try:
        models.add_code_path(args.code_path or [])
        labels = args.labels.read_text().split() if args.labels else None
        fields: dict[str, object] = {"min_agreement": args.min_agreement} if args.min_agreement is not None else {}
        inputs = importer.sequence_inputs(
            [importer.parse_tensor(t, "--input") for t in args.input], args.max_length, args.mask
        )
        if args.input_format is not None:
            inputs = importer.with_format(inputs, args.input_format)
        if args.text:
            feeds = next((t.name for t in inputs if t.variable), None)
            fields["text"] = {"input": args.text, "feeds": feeds}
        result = importer.import_model(
            args.source,
            args.store,
            args.name,
            args.architecture,
            inputs,
            [importer.parse_tensor(t, "--output") for t in args.output] if args.output else None,
            importer.parse_json_object(args.arch_kwargs, "--arch-kwargs"),
            labels,
            args.calibration,
            args.samples,
            resolve_device(args.device),
            **fields,
        )
    except ValidationError as e:
        print(f"halfserve import: {store.describe(e)}", file=sys.stderr)
        return 2
    except (store.StoreError, models.UnknownArchitectureError, ValueError, OSError) as e:
        print(f"halfserve import: {e}", file=sys.stderr)
        return 2
    print(importer.describe(result))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="halfserve", description="Half-precision PyTorch inference server.")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_serve(sub)
    _add_import(sub)
    train_cli.add_parser(sub)
    loadtest_cli.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
