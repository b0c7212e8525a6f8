"""The ``halfserve`` command: ``serve``, ``train`` and ``loadtest``."""

from __future__ import annotations

import argparse
import logging
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
import typing
from collections.abc import Sequence
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from halfserve import storage
from halfserve.manifest import describe
from halfserve.settings import MAX_IMAGE_PIXELS, MOST_IMAGE_PIXELS, Settings

if TYPE_CHECKING:
    from halfserve.codecopies import CodeCopies
    from halfserve.mar import Archive
    from halfserve.multiproc.supervisor import Frontends


def _help(name: str, field: FieldInfo) -> str:
    """A setting's ``--help`` line: its docstring's first sentence, without markup, and its default."""
    text = " ".join((field.description or name.replace("_", " ")).split())
    text = re.sub(r":\w+:`~?([^`]+)`", r"\1", text.replace("``", "`")).replace("`", "")
    first = re.split(r"(?<=[.])\s", text, maxsplit=1)[0].rstrip(".")
    default = field.default
    if isinstance(default, Enum):
        default = default.value
    if isinstance(default, bool):
        default = "on" if default else "off"
    shown = "" if default is None or default is PydanticUndefined or default == [] else f" (default: {default})"
    # Lowered as argparse's own help lines are, but not an acronym's first letter ("HTTP front-end processes").
    lowered = first if re.match(r"[A-Z]{2}", first) else first[0].lower() + first[1:]
    return (lowered + shown).replace("%", "%%")


def add_settings_flags(p: argparse.ArgumentParser) -> None:
    """A flag per :class:`~halfserve.settings.Settings` field, named, typed and explained by the field itself: ``--x-y``
    for ``x_y``, its choices from its enum, ``--x/--no-x`` for a switch, its help from its docstring."""
    for name, field in Settings.model_fields.items():
        flag = "--" + name.replace("_", "-")
        kind = field.annotation
        args = typing.get_args(kind)
        if type(None) in args:  # Optional[X]: the flag takes X
            kind = next(a for a in args if a is not type(None))
        kwargs: dict[str, Any] = {"help": _help(name, field), "default": None}
        if kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif isinstance(kind, type) and issubclass(kind, Enum):
            kwargs["choices"] = [e.value for e in kind]
        elif typing.get_origin(kind) is list:
            if typing.get_args(kind) == (Path,):  # a folder per flag, repeatable
                kwargs.update(action="append", type=Path, metavar="DIR")
            else:  # comma-separated, as in the environment
                kwargs["metavar"] = "A,B"
        elif kind in (int, float, Path):
            kwargs["type"] = kind
        p.add_argument(flag, **kwargs)


def _add_serve(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "serve",
        help="serve the models of a model store over HTTP",
        description="Serve a model store. Every flag has a HALFSERVE_<FLAG> environment variable; flags win.",
    )
    add_settings_flags(p)
    p.set_defaults(func=serve)


def serve(args: argparse.Namespace) -> int:
    from halfserve import logs, models, openfiles
    from halfserve.app import begin_drain, create_app
    from halfserve.httpserver import DrainingServer, uvicorn_config
    from halfserve.multiproc.supervisor import Frontends
    from halfserve.repository import ModelRepository
    from halfserve.settings import Settings

    fields = set(Settings.model_fields)
    given = {k: v for k, v in vars(args).items() if k in fields and v is not None}
    try:
        settings = Settings(**given)
        models.add_code_path(settings.code_path)
        models.forbid_store(settings.store)
        # Validate every manifest and architecture before binding the port, so a bad store fails with the file and
        # field named.
        ModelRepository(settings).discover()
    except (ValidationError, storage.StoreError, ValueError, models.UnknownArchitectureError) as e:
        print(f"halfserve serve: {e}", file=sys.stderr)
        return 2
    log_config = logs.configure(settings.log_format, settings.log_level.value, settings.access_log)
    openfiles.raise_limit(settings)
    if args.admin_token is not None:
        logging.getLogger(__name__).warning(
            "--admin-token shows in the process list (ps, /proc); pass HALFSERVE_ADMIN_TOKEN or --admin-token-file"
        )
    frontends: Frontends | None = None
    where: dict[str, Any] = {"host": settings.host, "port": settings.port}
    if settings.http_workers > 1:
        # The front-ends share the listening socket; this process serves its API to them on a Unix socket.
        try:
            sock = listen(settings.host, settings.port)
        except OSError as e:
            print(
                f"halfserve serve: cannot listen on {settings.host}:{settings.port}: {e.strerror or e}", file=sys.stderr
            )
            return STARTUP_FAILURE
        # The front-ends' uvicorn logs no address of its own: a port 0 (any free one) is known only from here.
        bound = sock.getsockname()
        logging.getLogger(__name__).info(
            "HTTP on %s:%d, answered by %d front-end processes", bound[0], bound[1], settings.http_workers
        )
        frontends = Frontends(settings, sock, tempfile.mkdtemp(prefix="halfserve-"))
        where = {"uds": frontends.api_socket}
    app = create_app(settings, frontends)
    config = uvicorn_config(app, settings, log_config, app.direct_routes(), **where)

    def remove_temporary_files() -> None:
        if frontends is not None:
            shutil.rmtree(os.path.dirname(frontends.api_socket), ignore_errors=True)

    server = DrainingServer(config, lambda: begin_drain(app), remove_temporary_files)
    if frontends is not None:
        frontends.on_failure = lambda: server.handle_exit(signal.SIGTERM, None)
    try:
        server.run()
    except SystemExit as e:  # uvicorn's exit when its start failed: the cause, as the last line, for a supervisor
        # The app's start failed with startup_error, or else (uvicorn's only other exit at start) the port's bind,
        # whose error uvicorn logged above.
        default = f"cannot listen on {settings.host}:{settings.port} (the error above)"
        print(f"halfserve serve: could not start: {getattr(app.state, 'startup_error', default)}", file=sys.stderr)
        return e.code if isinstance(e.code, int) and e.code != 0 else STARTUP_FAILURE
    finally:
        remove_temporary_files()  # also when the server failed to start
    if frontends is not None and frontends.failure is not None:
        print(f"halfserve serve: {frontends.failure}", file=sys.stderr)
        server.exit_past_drain(STARTUP_FAILURE)
        return STARTUP_FAILURE
    server.exit_past_drain(0)
    return 0


STARTUP_FAILURE = 3
"""The exit status when the server could not start (a port taken, a process that failed at start): uvicorn's."""


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
    p.add_argument(
        "source",
        type=Path,
        help=".pt/.pth state dict, .safetensors file, Hugging Face model folder, or TorchServe .mar archive",
    )
    p.add_argument("--name", help="the model's name in the store (a .mar: default its modelName)")
    p.add_argument(
        "--architecture",
        help="registered name, package.module:factory, torchvision:<builder> or transformers:<AutoClass> "
        "(a .mar: default its model file, with --trust-model-file)",
    )
    p.add_argument(
        "--trust-model-file",
        action="store_true",
        help="a .mar's model file is Python code: copy it into the first --code-path folder and build it",
    )
    p.add_argument(
        "--archive-code",
        type=Path,
        metavar="DIR",
        help="a .mar's own handler file is Python code: copy it and the archive's other .py files into DIR, a folder "
        "of yours outside the store, and run the handler (serve with --code-path DIR)",
    )
    p.add_argument("--arch-kwargs", help="JSON object of the factory's keyword arguments")
    p.add_argument(
        "--input",
        action="append",
        metavar="NAME:DTYPE:SHAPE",
        help="e.g. image:FP32:3x224x224 (a .mar with image_classifier: default input:FP32:3x224x224)",
    )
    p.add_argument(
        "--input-format",
        metavar="FORMAT",
        help="NCHW, NHWC or NONE: the layout of the image inputs (three dimensions), as Triton's model config reports "
        "it to clients; default: from the shape where unambiguous (3x224x224 is NCHW, 224x224x3 NHWC)",
    )
    p.add_argument(
        "--output",
        action="append",
        metavar="NAME:DTYPE:SHAPE",
        help="default: from one forward; no SHAPE (value:FP32:) for one value per row, a [B] tensor",
    )
    p.add_argument("--max-length", type=int, help="the longest length of variable (-1) inputs")
    p.add_argument("--mask", metavar="NAME", help="an attention mask input the server builds for the variable input")
    p.add_argument(
        "--truncate", action="store_true", help="cut requests (and texts) longer than --max-length instead of refusing"
    )
    p.add_argument(
        "--accept-padding-variance",
        action="store_true",
        help="import a model whose answers change with the batch's padding (manifest padding_invariant: false)",
    )
    p.add_argument("--text", metavar="NAME", help="a text input tokenized with the folder's tokenizer.json")
    p.add_argument(
        "--labels",
        type=Path,
        help="text file with one class name per line (the first output's), or TorchServe's index_to_name.json; "
        "default: a Hugging Face folder's id2label",
    )
    _add_image_flags(p)
    p.add_argument(
        "--answer",
        metavar="SHAPE",
        help="detections or segmentation: /predictions answers as TorchServe's object_detector or image_segmenter "
        'from the outputs boxes, scores, labels or out; or JSON, e.g. {"detections": {"threshold": 0.3}}',
    )
    p.add_argument(
        "--handler",
        metavar="MODULE:NAME",
        help="a team's own preprocess/postprocess class in a --code-path module, for /predictions (docs/handlers.md)",
    )
    p.add_argument(
        "--calibration",
        type=Path,
        help=".npy (one input), .npz, .safetensors or .jsonl samples by input name, .txt texts, or a folder of images",
    )
    p.add_argument(
        "--max-image-pixels",
        type=int,
        default=MAX_IMAGE_PIXELS,
        metavar="N",
        help="most pixels (width times height, read from its header before decoding) a calibration photo may have, "
        f"as serve's flag of the name holds requests' (default: {MAX_IMAGE_PIXELS}; at most {MOST_IMAGE_PIXELS})",
    )
    p.add_argument("--samples", type=int, default=64, help="random calibration samples without --calibration")
    p.add_argument(
        "--min-agreement", type=float, help="serve in fp32 below this top-1 agreement (default: the default bar, 0.98)"
    )
    p.add_argument(
        "--fidelity",
        metavar="JSON",
        help='the manifest\'s fidelity bar, e.g. {"min_cosine": 0.99} or {"check": false} (default: the default bar)',
    )
    p.add_argument(
        "--strict",
        action="store_true",
        help="refuse a model below its fidelity bar (exit 2, nothing written) rather than import it to serve in fp32",
    )
    p.add_argument("--store", type=Path, default=Path("model_store"), help="model store folder (default: model_store)")
    p.add_argument("--code-path", type=Path, action="append", metavar="DIR", help="folder for module:factory code")
    p.add_argument("--device", default="auto", help="where the half-precision agreement is measured")
    p.set_defaults(func=import_)


IMAGE_FLAGS = {
    "mode": "RGB or L: the colour mode images are converted to (default RGB)",
    "resize": "the shorter side's new size (256), or HEIGHTxWIDTH exactly (8x8)",
    "interpolation": "bilinear (default), nearest or bicubic: the resize's filter",
    "crop": "the centre kept after the resize: a size (224) or HEIGHTxWIDTH",
    "scale": "what each pixel value (0..255) is multiplied by (default 1/255)",
    "mean": "comma-separated, one per channel: subtracted after the scale",
    "std": "comma-separated, one per channel: divided by after the mean",
    "layout": "CHW (default) or HWC: where the channels go in the input",
    "draft": "auto (default), on or off: decode a large JPEG reduced (libjpeg's DCT scaling) to twice the resize, "
    "then resize, a phone photo's decoding at a fraction; auto turns it on where the --calibration photos show the "
    "model's answers unchanged, off (with the reason) where they do not or none is large enough",
}
"""The ``--image-*`` flags of ``halfserve import``: the manifest's ``image`` section's fields."""


def _add_image_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--image",
        metavar="NAME",
        help="photos (JPEG, PNG, WebP) clients send, decoded and transformed into the model's one input",
    )
    p.add_argument(
        "--image-preset",
        metavar="PRESET",
        help="torchserve: TorchServe's image_classifier transforms (RGB, resize 256, crop 224, ImageNet mean and "
        "std); --image-* flags given beside it override its values",
    )
    for field, help_text in IMAGE_FLAGS.items():
        p.add_argument(f"--image-{field}", help=help_text)


def import_(args: argparse.Namespace) -> int:
    from halfserve import importer, importflags, mar, models
    from halfserve.codecopies import CodeCopies
    from halfserve.precision import resolve_device

    scratch = tempfile.TemporaryDirectory(prefix="halfserve-mar-")
    extra: dict[str, Path] = {}
    copies = CodeCopies()  # an archive's code, in place only once the import is accepted
    try:
        if args.source.suffix == ".mar":
            archive = mar.read(args.source, Path(scratch.name))
            _from_archive(args, archive, copies)
            extra = mar.extra_files(archive) if archive.handler_file is not None else {}
        elif args.archive_code is not None:
            raise importer.ImportFailure("--archive-code: only a .mar archive ships a handler file of its own")
        else:
            _check_code_folders(args)
        missing = [f"--{n}" for n in ("name", "architecture", "input") if not getattr(args, n)]
        if missing:
            raise importer.ImportFailure(f"give {', '.join(missing)}")
        if not 1 <= args.max_image_pixels <= MOST_IMAGE_PIXELS:
            raise importer.ImportFailure(f"--max-image-pixels {args.max_image_pixels}: from 1 to {MOST_IMAGE_PIXELS}")
        models.add_code_path(args.code_path or [])
        models.add_code_path(copies.folders)  # the model and handler build from there
        models.forbid_store(args.store)
        labels = importflags.read_labels(args.labels) if args.labels else None
        fields: dict[str, object] = {"min_agreement": args.min_agreement} if args.min_agreement is not None else {}
        if args.accept_padding_variance:
            fields["padding_invariant"] = False
        if args.fidelity is not None:
            fields["fidelity"] = importflags.parse_json_object(args.fidelity, "--fidelity")
        inputs = importer.sequence_inputs(
            [importflags.parse_tensor(t, "--input") for t in args.input], args.max_length, args.mask, args.truncate
        )
        if args.input_format is not None:
            inputs = importflags.with_format(inputs, args.input_format)
        if args.text:
            feeds = next((t.name for t in inputs if t.variable), None)
            fields["text"] = {"input": args.text, "feeds": feeds}
        given = {f: getattr(args, f"image_{f}") for f in IMAGE_FLAGS}
        if args.image:
            fields["image"] = importflags.image_section(args.image, inputs, args.image_preset, **given)
        elif args.image_preset is not None or any(v is not None for v in given.values()):
            raise importer.ImportFailure("--image-*: give --image NAME too, the name clients send images under")
        if args.handler:
            fields["handler"] = {"code": args.handler, **({"style": "torchserve"} if extra else {})}
        if args.answer:
            fields["answer"] = _answer(args.answer)
        result = importer.import_model(
            args.source,
            args.store,
            args.name,
            args.architecture,
            inputs,
            [importflags.parse_tensor(t, "--output") for t in args.output] if args.output else None,
            importflags.parse_json_object(args.arch_kwargs, "--arch-kwargs"),
            labels,
            args.calibration,
            args.samples,
            resolve_device(args.device),
            args.strict,
            extra,
            max_image_pixels=args.max_image_pixels,
            index_labels=getattr(args, "index_labels", False),
            **fields,
        )
        copies.install()
    except ValidationError as e:
        print(f"halfserve import: {describe(e)}", file=sys.stderr)
        return 2
    except (storage.StoreError, models.UnknownArchitectureError, ValueError, OSError) as e:
        print(f"halfserve import: {e}", file=sys.stderr)
        return 2
    finally:
        copies.discard()  # a refused import leaves the code folders as they were
        scratch.cleanup()
    print(importer.describe(result))
    if extra:  # the handler's folder, and the model file's where that is another
        folders = " ".join(f"--code-path {p}" for p in dict.fromkeys(args.code_path))
        print(f"  serve it with: halfserve serve --store {args.store} {folders} (its handler is there)")
    elif args.trust_model_file and args.code_path:
        print(f"  serve it with --code-path {args.code_path[0]} (its model file is there)")
    return 0


def _answer(text: str) -> dict[str, object]:
    """``--answer``: a shape's name (its outputs and threshold at their defaults), or the section as JSON."""
    from halfserve import importer, importflags
    from halfserve.answershapes import AnswerSection

    if text in AnswerSection.model_fields:
        return {text: {}}
    if not text.lstrip().startswith("{"):
        shapes = " or ".join(AnswerSection.model_fields)
        raise importer.ImportFailure(f"--answer {text!r}: expected {shapes}, or the section as a JSON object")
    return importflags.parse_json_object(text, "--answer")


def _from_archive(args: argparse.Namespace, archive: Archive, copies: CodeCopies) -> None:
    """Fill what a TorchServe archive gives (:mod:`halfserve.mar`) where the command line did not."""
    from halfserve import importflags, mar

    args.source = archive.weights
    given = args.name is not None
    args.name = args.name or archive.name
    try:  # before anything is written for it (the model file copied, last)
        storage.check_name(args.name)
    except storage.StoreError as e:
        where = "--name" if given else "the archive's modelName is not a store name; give --name"
        raise mar.MarError(f"{e}: {where}") from None
    _check_code_folders(args)
    if archive.handler_file is not None:
        _archive_handler(args, archive)
    elif args.archive_code is not None:
        raise mar.MarError(f"--archive-code: the archive's handler is the stock {archive.handler!r}, not a file")
    elif archive.handler == mar.OBJECT_DETECTOR:  # ToTensor alone: images of any size, which a batch cannot hold
        if not args.input:
            raise mar.MarError(
                f"{archive.name}: object_detector takes images of any size, and a batch holds one: give --input "
                "NAME:FP32:3xHEIGHTxWIDTH, the size images are resized to (boxes answer in its pixels)"
            )

        shape = importflags.parse_tensor(args.input[0], "--input").shape
        args.image_resize = args.image_resize or f"{shape[-2]}x{shape[-1]}"
    else:
        args.input = args.input or [mar.IMAGE_INPUT]
        args.image_preset = args.image_preset or "torchserve"
    if archive.handler_file is None:
        if args.image is None and any(importflags.parse_tensor(t, "--input").name == mar.IMAGE for t in args.input):
            raise mar.MarError(
                f"--input {mar.IMAGE}: photos are sent under the name {mar.IMAGE!r} (V2's input, beside the tensor "
                "they feed), so the tensor input needs another name (--input input:FP32:...), or the photos another "
                "with --image NAME"
            )
        args.image = args.image or mar.IMAGE
        args.answer = args.answer or mar.STOCK_ANSWERS[archive.handler]
    if args.architecture is None:
        if archive.model_file is None:
            raise mar.MarError(f"{archive.name}: the archive has no model file: give --architecture")
        if not args.trust_model_file:
            raise mar.refused_model_file(archive)
        args.architecture = mar.trust_model_file(archive, args.code_path or [], copies)
    if args.labels is None and archive.labels is not None:
        args.labels = archive.labels
    # TorchServe's image_classifier names each class by its index where the archive has no index_to_name.json.
    args.index_labels = archive.handler == mar.IMAGE_CLASSIFIER and args.labels is None
    if archive.handler_file is not None:  # last, as the model file is: copied once the rest is settled
        args.handler = mar.extract_code(archive, args.archive_code, args.store, copies)
        args.code_path = [*(args.code_path or []), args.archive_code]


def _check_code_folders(args: argparse.Namespace) -> None:
    """Before anything is written: no ``--code-path`` folder that is the store or lies in a model folder of it (the
    imported model's included), and no ``--archive-code`` folder in the store."""
    from halfserve import mar, models

    for folder in args.code_path or []:
        models.check_code_folder(args.store, folder, "--code-path", args.name)
    if args.archive_code is not None:
        mar.check_archive_code(args.archive_code, args.store)


def _archive_handler(args: argparse.Namespace, archive: Archive) -> None:
    """An archive's own handler file: refused without ``--archive-code``; with it, copied there (after the checks
    that need nothing copied) and named as the manifest's torchserve-style handler."""
    from halfserve import mar

    if args.archive_code is None:
        raise mar.refused_handler_file(archive)
    if args.handler is not None:
        raise mar.MarError("--handler: the archive's handler file is the handler; give one or the other")
    assert archive.handler_file is not None
    _, image_classifier = mar.handler_class(archive.handler_file)
    if not args.input and not image_classifier:
        raise mar.MarError(
            f"{archive.name}: give --input NAME:DTYPE:SHAPE, one row of what the handler's preprocess returns "
            "(an ImageClassifier's is input:FP32:3x224x224, the default for one)"
        )
    args.input = args.input or [mar.IMAGE_INPUT]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="halfserve", description="Half-precision PyTorch inference server.")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_serve(sub)
    _add_import(sub)
    # Here, not at the top: importing this module must not import torch (training's modules do), as a front-end
    # process spawned from the halfserve script imports the script, and so this module, again.
    from halfserve.loadtest import cli as loadtest_cli
    from halfserve.training import cli as train_cli

    train_cli.add_parser(sub)
    loadtest_cli.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
