"""The manifest's ``handler`` section: a team's own pre- and post-processing code, as a TorchServe custom handler is,
named ``package.module:Name`` and resolved under the architectures' trust rule (its module must lie in one of the
operator's ``--code-path`` folders, never in a model folder: :func:`halfserve.models.resolve_code`).

Torch-free and import-free: the manifest imports it, and naming the code here runs none of it.
"""

from __future__ import annotations

import enum
import re

from pydantic import BaseModel, ConfigDict, Field, field_validator

_IDENTIFIER = r"[A-Za-z_][A-Za-z0-9_]*"
CODE_FORM = re.compile(rf"{_IDENTIFIER}(?:\.{_IDENTIFIER})*:{_IDENTIFIER}")
"""``package.module:Name``: a class (or a function returning the handler) defined in that module."""
DEFAULT_TIMEOUT_S = 10.0
MAX_TIMEOUT_S = 600.0


class HandlerStyle(str, enum.Enum):
    """Which contract the handler's class keeps."""

    HALFSERVE = "halfserve"
    """Built with no arguments; ``preprocess(requests)`` and ``postprocess(outputs, requests)`` (docs/handlers.md)."""
    TORCHSERVE = "torchserve"
    """A TorchServe handler class, as a ``.mar`` ships it: ``initialize(context)`` once, ``preprocess(data)`` and
    ``postprocess(output)`` with the output as a torch tensor; the server runs the forward
    (:mod:`halfserve.tscompat`)."""


class HandlerSection(BaseModel):
    """Which code turns a request's payloads into the model's inputs and its outputs into answers
    (docs/handlers.md)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    code: str = Field(max_length=256)
    """``package.module:Name``: called with no arguments once per loaded version; the object it returns has
    ``preprocess(requests)`` and ``postprocess(outputs, requests)``."""
    style: HandlerStyle = HandlerStyle.HALFSERVE
    timeout_s: float = Field(default=DEFAULT_TIMEOUT_S, gt=0, le=MAX_TIMEOUT_S)
    """Longest a ``preprocess`` or a ``postprocess`` call may run before its request is answered 504."""

    @field_validator("code")
    @classmethod
    def _form(cls, code: str) -> str:
        if not CODE_FORM.fullmatch(code):
            raise ValueError(f"{code!r}: expected 'package.module:Name', a class or function of a --code-path module")
        return code
