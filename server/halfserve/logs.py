"""Logging for ``halfserve serve``: text for people, or one JSON object per line for log collectors.

Fields a log call passes in ``extra`` (``request_id``, ``model``, ``status``...) become keys of the JSON object, so
a collector can filter on them without parsing the message.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import orjson

from halfserve.settings import LogFormat

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
ACCESS_LOGGER = "halfserve.access"

# Every attribute a LogRecord has before ``extra`` is applied; whatever else it carries came from ``extra``.
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    """A record as one line of JSON: ``time`` (UTC, ISO 8601), ``level``, ``logger``, ``message``, the record's
    ``extra`` fields, and ``exception`` with the traceback when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_"):
                entry[key] = value
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return orjson.dumps(entry, default=str).decode()


class SkipInference(logging.Filter):
    """Drops uvicorn's access lines for inference requests, which the server logs itself with their request id."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if not isinstance(args, tuple) or len(args) < 3:
            return True
        method, path = args[1], str(args[2]).partition("?")[0]
        return not (method == "POST" and (path == "/predict" or path.endswith("/infer")))


_CONTROLS = {c: f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}" for c in (*range(0x20), 0x7F, 0x85, 0x2028, 0x2029)}
"""Control characters and line separators as the escapes a log line shows for them (``\\x0d``)."""


class EscapeControls(logging.Filter):
    """Writes the control characters of a record's string arguments as escapes: the access lines (uvicorn's and the
    server's own) quote the request's decoded path, in which ``%0d%0a`` is a line break that would let a client write
    a line of its own into a text log, and ``%1b`` a terminal's escape sequence."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and any(isinstance(a, str) and not a.isprintable() for a in args):
            record.args = tuple(a.translate(_CONTROLS) if isinstance(a, str) else a for a in args)
        return True


def configure(fmt: LogFormat, level: str, access_log: bool = False) -> dict[str, Any] | None:
    """Set up the root logger for ``fmt`` at ``level``; returns the ``log_config`` to hand uvicorn.

    For JSON, uvicorn gets ``None`` (it configures nothing) and its loggers propagate to the root's JSON handler.
    ``access_log`` turns on the line per inference request (``halfserve.access`` at INFO); without it, that logger
    passes only failures.
    """
    import uvicorn.config

    root = logging.getLogger()
    root.setLevel(level.upper())
    handler = logging.StreamHandler()
    if fmt is LogFormat.JSON:
        handler.setFormatter(JsonFormatter())
        config = None
    else:
        handler.setFormatter(logging.Formatter(TEXT_FORMAT))
        config = uvicorn.config.LOGGING_CONFIG
    root.handlers = [handler]
    logging.getLogger(ACCESS_LOGGER).setLevel(logging.INFO if access_log else logging.WARNING)
    for name, kinds in (("uvicorn.access", (SkipInference, EscapeControls)), (ACCESS_LOGGER, (EscapeControls,))):
        logger = logging.getLogger(name)
        for kind in kinds:
            if not any(isinstance(f, kind) for f in logger.filters):  # configured once per process, called per server
                logger.addFilter(kind())
    return config
